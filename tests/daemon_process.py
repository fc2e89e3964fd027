"""Run a real `loraplex serve` in a subprocess for tests, with private runtime
and state directories, and stop it cleanly (or report how it died)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loraplex.ipc.client import Client, LoraplexError

SPARES = {"LORAPLEX_SERVER_SPARE_CHILDREN": "true"}  # server.spare_children, off by default in tests


class DaemonProcess:
    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.runtime_dir = root / "rt"
        self.state_dir = root / "state"
        self.log_path = root / "daemon.log"
        # Warm spares cost each daemon ~4 CPU-seconds of imports; the tests of recovery ask for them (SPARES).
        self.env = {"LORAPLEX_SERVER_SPARE_CHILDREN": "false", **os.environ,
                    "LORAPLEX_RUNTIME_DIR": str(self.runtime_dir), "LORAPLEX_STATE_DIR": str(self.state_dir),
                    **(env or {})}
        self.args = ["--num-pages", "600", "--max-num-seqs", "16", *args]
        self.proc: subprocess.Popen | None = None

    @property
    def instance(self) -> str:
        from loraplex.ipc.runtime_dir import instance_id

        return instance_id(self.runtime_dir)

    def start(self, timeout_s: float = 120.0) -> DaemonProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "serve", *self.args], env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if (self.runtime_dir / "client.sock").exists():
                try:
                    with self.client() as c:
                        c.ping(timeout=2.0)
                    return self
                except LoraplexError:
                    pass
            time.sleep(0.2)
        self.proc.kill()  # never leave a daemon that did not come up running behind the test
        self.proc.wait()
        raise TimeoutError(f"daemon did not come up:\n{self.log()}")

    def client(self) -> Client:
        return Client(runtime_dir=self.runtime_dir)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def cpu_assisted_greedy(root: Path, model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
                        names: list[str | None], max_tokens: int, *,
                        throttle_bytes_s: str = "3e6") -> tuple[list, dict]:
    """Greedy completions of `prompts` (row i with adapter names[i]) from a daemon with CPU workers
    computing the early layers' LoRA while a throttled load streams in; (results, the stats after)."""
    args = [arg for name in sorted(set(names) - {None}) for arg in ("--adapter", f"{name}={adapters[name]}")]
    root.mkdir()
    proc = DaemonProcess(root, "--model", str(model_dir), "--adapter-load-mode", "cpu_assist", "--cpu-workers", "2",
                         *args, env={"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": throttle_bytes_s})
    proc.start()
    try:
        with proc.client() as client:
            got = [client.generate(p, adapter=a, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120)
                   for p, a in zip(prompts, names)]
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    return got, stats
