"""One stage of the GPU validation: a list of items run against a time budget,
each recorded as ok, failed or skipped with its reason, plus the stage's
figures and targets; written as `<out>/<stage>.json` and a part of
`<out>/summary.md`.

Items that run a bench script or pytest do so in a child process with a
deadline taken from what is left of the budget, so one hung item costs its own
time, never the stage's report. Nothing here imports torch: the stage survives
an environment where the engine side does not even import.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
TAIL_CHARS = 3000  # of a failed child's stderr kept in the JSON
RESERVE_S = 10.0  # kept back from every item's deadline for writing the report


def run_as_group(cmd: list[str], *, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own: past the deadline the whole process group is
    killed, not only the direct child (a bench script's daemons and engines outlived it, still
    holding the GPU and the CPUs for the steps after)."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout_s, output=out, stderr=err) from None
        except BaseException:
            _kill_group(proc.pid)
            raise
        _kill_group(proc.pid)  # what the child left running in its group goes with it
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(slots=True)
class Item:
    name: str
    status: str  # ok | failed | skipped
    seconds: float = 0.0
    reason: str | None = None  # why skipped or failed
    figures: dict[str, Any] = field(default_factory=dict)
    command: str | None = None


@dataclass(slots=True)
class Target:
    name: str
    value: float | None
    bound: float
    sense: str  # "<=" or ">="
    source: str  # where the target comes from (paper figure, issue, our own bar)

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.bound if self.sense == "<=" else self.value >= self.bound


@dataclass(slots=True)
class StageContext:
    """What a stage knows of its run: device, dry run, output folder, budget."""

    stage: str
    out: Path
    dry_run: bool
    device: str  # cuda or cpu
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    # In a window, a child gets at most this many times its estimate (and at least a minute more), so
    # one hung item cannot take the time of every step after it; None: whatever the budget leaves.
    cap_factor: float | None = None
    items: list[Item] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def skip(self, name: str, reason: str) -> None:
        self.items.append(Item(name, "skipped", reason=reason))
        log(f"[{self.stage}] {name}: skipped ({reason})")

    def needs_cuda(self, name: str, why: str) -> bool:
        """True when CUDA is here; otherwise records `name` as skipped with `why`."""
        if self.cuda:
            return True
        self.skip(name, why)
        return False

    def child_env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not self.cuda:
            env["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU run under the interpreter
            env.setdefault("LORAPLEX_DEMO", "random")
        return env

    def run(self, name: str, argv: list[str], *, est_s: float, cap_s: float | None = None,
            parse_json: bool = True, ok_codes: tuple[int, ...] = (0,)) -> dict[str, Any] | None:
        """Run a child `argv` (bench scripts by file name) with a deadline; its stdout JSON, or None
        when it failed, timed out or was skipped for want of budget (each recorded as an item)."""
        left = self.left_s() - RESERVE_S
        if left < est_s:
            self.skip(name, f"budget: {max(left, 0):.0f} s left, needs about {est_s:.0f} s")
            return None
        timeout = min(left, cap_s) if cap_s else left
        if self.cap_factor:
            timeout = min(timeout, max(self.cap_factor * est_s, est_s + 60))
        cmd = [sys.executable, str(BENCH / argv[0]), *argv[1:]] if argv[0].endswith(".py") else argv
        shown = " ".join(str(a) for a in (["python", f"bench/{argv[0]}", *argv[1:]] if argv[0].endswith(".py")
                                          else argv))
        log(f"[{self.stage}] {name}: {shown} (deadline {timeout:.0f} s)")
        started = time.monotonic()
        try:
            proc = run_as_group(cmd, env=self.child_env(), timeout_s=timeout)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            self._record(name, "failed", started, f"timed out after {timeout:.0f} s: {err[-TAIL_CHARS:]}", {},
                         shown)
            return None
        result: dict[str, Any] | None = None
        status, reason = "ok", None
        if proc.returncode not in ok_codes:
            status, reason = "failed", f"exit {proc.returncode}: {proc.stderr[-TAIL_CHARS:]}"
        if parse_json:
            try:
                result = json.loads(proc.stdout)
            except ValueError:
                status = "failed"
                reason = (reason or "") + f" stdout is not one JSON object: {proc.stdout[-500:]!r}"
        else:
            result = {"stdout_tail": proc.stdout[-TAIL_CHARS:]}
        self._record(name, status, started, reason, {}, shown)
        return result if status == "ok" else None

    def _record(self, name: str, status: str, started: float, reason: str | None, figures: dict[str, Any],
                command: str | None) -> Item:
        item = Item(name, status, round(time.monotonic() - started, 2), reason, figures, command)
        self.items.append(item)
        log(f"[{self.stage}] {name}: {status} in {item.seconds:.1f} s" + (f" ({reason[:300]})" if reason else ""))
        return item

    def call(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """An in-process item: `fn` returns its figures, or raises to fail."""
        started = time.monotonic()
        try:
            figures = fn()
        except Exception as exc:  # noqa: BLE001 - recorded as the item's failure
            self._record(name, "failed", started, f"{type(exc).__name__}: {exc}", {}, None)
            return None
        self._record(name, "ok", started, None, figures, None)
        return figures

    def note(self, name: str, **figures: Any) -> None:
        """Attach figures to the last item called `name`."""
        for item in reversed(self.items):
            if item.name == name:
                item.figures.update(figures)
                return

    def target(self, name: str, value: float | None, bound: float, sense: str, source: str) -> None:
        self.targets.append(Target(name, None if value is None else round(float(value), 4), bound, sense, source))

    def report(self, device_info: dict[str, Any]) -> dict[str, Any]:
        failed = [i.name for i in self.items if i.status == "failed"]
        return {"stage": self.stage, "device": device_info.get("name", self.device), "device_info": device_info,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "dry_run": self.dry_run, "ok": not failed, "failed": failed,
                "seconds": round(time.monotonic() - self.started, 2), "budget_s": self.budget_s,
                "items": [asdict(i) for i in self.items], "figures": self.figures,
                # a dry run's figures come from toy sizes on a CPU: no target can be met or missed there
                "targets": [{**asdict(t), "met": None if self.dry_run else t.met} for t in self.targets]}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def device_info(dry_run: bool) -> dict[str, Any]:
    """The machine the stage ran on, read in a child so a broken torch cannot take the stage down."""
    probe = ("import json, os, platform, torch\n"
             "cuda = torch.cuda.is_available()\n"
             "info = {'torch': torch.__version__, 'cuda_available': cuda, 'cpu_count': os.cpu_count(),\n"
             "        'python': platform.python_version()}\n"
             "if cuda:\n"
             "    p = torch.cuda.get_device_properties(0)\n"
             "    info.update(name=torch.cuda.get_device_name(0), cuda=torch.version.cuda,\n"
             "                memory_gib=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count)\n"
             "try:\n"
             "    import triton; info['triton'] = triton.__version__\n"
             "except ImportError:\n"
             "    info['triton'] = None\n"
             "print(json.dumps(info))\n")
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "dry_run": dry_run}
    try:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
        info.update(json.loads(proc.stdout))
    except (subprocess.SubprocessError, ValueError) as exc:
        info["probe_error"] = str(exc)[-500:]
    if not info.get("cuda_available"):
        info["name"] = f"CPU {info['cpu']} ({info.get('cpu_count')} cores)"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10, check=True).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        info["commit"] = None
    return info
