"""Fault injection against real daemons on CPU: engine SIGKILL / SIGSTOP mid-prefill
and mid-decode and while idle, a forward that raises, a simulated CUDA OOM, CPU worker SIGKILL /
SIGSTOP mid-prefill, daemon SIGKILL (children exit, the restart sweeps), SIGTERM under load.

Every case ends with the affected requests carrying exactly the tokens of an undisturbed greedy
run (or a typed error), the child replaced where it had to be, and no shared memory left behind.
Forward faults are armed at run time through the engine's test-only LORAPLEX_FAULTS file hook.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.ipc.client import LoraplexError
from tests.daemon_process import SPARES, DaemonProcess

LONG_PROMPT = [3 + (7 * i) % 500 for i in range(300)]  # a cold adapter + throttled load: a long prefill
DECODE_PROMPT = [4, 5, 6]
THROTTLE = {"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "3e6"}  # all-r32 (2.4 MB) loads for ~0.8 s


def _model_args(demo) -> list[str]:
    args = ["--model", str(demo.model_dir)]
    for name, path in demo.adapters.items():
        args += ["--adapter", f"{name}={path}"]
    return args


def _segments(instance: str) -> list[str]:
    return [p for p in os.listdir("/dev/shm") if p.startswith(f"lpx-{instance}-")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _reap(pid: int | None) -> None:
    """End a child of our own daemon that a test stopped, if the daemon did not (cleanup only)."""
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGKILL)


def _stats(daemon) -> dict:
    with daemon.client() as c:
        return c.stats()


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


class Streamer(threading.Thread):
    """One streaming request on its own connection, recording when each chunk arrived."""

    def __init__(self, daemon, prompt, **kwargs) -> None:
        super().__init__(daemon=True)
        self.daemon_proc, self.prompt, self.kwargs = daemon, prompt, kwargs
        self.chunks: list[tuple[float, object]] = []
        self.result = None
        self.error: LoraplexError | None = None
        self.start()

    def run(self) -> None:
        try:
            with self.daemon_proc.client() as c:
                stream = c.stream(self.prompt, temperature=0.0, ignore_eos=True, timeout=120, **self.kwargs)
                for chunk in stream:
                    self.chunks.append((time.monotonic(), chunk))
                self.result = stream.result
        except LoraplexError as exc:
            self.error = exc

    def finish(self, timeout_s: float = 120.0):
        self.join(timeout_s)
        assert not self.is_alive(), "request still running"
        return self

    @property
    def token_ids(self) -> list[int]:
        return [t for _, c in self.chunks for t in c.token_ids]

    def check_exact(self, expected: list[int]) -> None:
        assert self.error is None, self.error
        assert self.token_ids == expected, "tokens lost, repeated or changed"
        assert [c.index for _, c in self.chunks if c.token_ids] == list(range(len(expected)))
        assert self.result is not None and self.result.token_ids == expected


@pytest.fixture(scope="module")
def offline(demo):
    llm = LLM(demo.model_dir, num_pages=600)
    for name in ("all-r32", "mlp-r64", "qv-r8"):
        llm.add_adapter(name, demo.adapters[name])

    def expected(prompt: list[int], adapter: str | None, max_tokens: int) -> list[int]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return llm.generate([prompt], adapters=[adapter], sampling=sampling)[0].token_ids

    return expected


def _fault_daemon(demo, tmp_path_factory, overlap: bool):
    """A daemon for the engine fault tests; faults are armed through a file."""
    root = tmp_path_factory.mktemp("faults")
    proc = DaemonProcess(root, *_model_args(demo),
                         env={**THROTTLE, **SPARES, "LORAPLEX_FAULTS": f"file={root / 'fault'}",
                              "LORAPLEX_SCHEDULER_OVERLAP": "true" if overlap else "false"})
    proc.fault_file = root / "fault"
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log()
    assert not _segments(proc.instance), "shared-memory segments left behind"
    assert not list(proc.runtime_dir.glob("*.sock"))


@pytest.fixture(scope="module")
def daemon(demo, tmp_path_factory):
    """One daemon shared by the engine fault tests, with the synchronous step loop."""
    yield from _fault_daemon(demo, tmp_path_factory, overlap=False)


@pytest.fixture(scope="module")
def overlapped(demo, tmp_path_factory):
    """The same with one step in flight ahead (scheduler.overlap)."""
    yield from _fault_daemon(demo, tmp_path_factory, overlap=True)


@pytest.fixture(params=["sync", "overlap"])
def either_loop(request):
    """The fault tests a step in flight ahead changes run against both loops."""
    return request.getfixturevalue("daemon" if request.param == "sync" else "overlapped")


def _arm(daemon, spec: str) -> None:
    tmp = daemon.fault_file.with_suffix(".tmp")
    tmp.write_text(spec)
    os.rename(tmp, daemon.fault_file)


def _engine(daemon) -> tuple[int, int]:
    stats = _stats(daemon)
    return stats["engine"]["pid"], stats["engine_restarts"]


def _wait_replaced(daemon, pid: int, timeout_s: float = 30.0) -> dict:
    return _wait(lambda: (s := _stats(daemon))["engine"]["pid"] not in (None, pid) and s["engine"]["ready"] and s,
                 timeout_s, f"engine {pid} to be replaced and ready")


def test_fault_specs_parse_and_bad_ones_are_refused():
    from loraplex.gpu_engine.faults import FaultInjector, parse_faults

    assert parse_faults("step_raise=3, step_oom=2x4") == {"step_raise": (3, 1), "step_oom": (2, 4)}
    for bad in ("step_raise", "step_raise=0", "explode=1", "step_oom=1x0"):
        with pytest.raises(ValueError):
            parse_faults(bad)
    injector = FaultInjector("step_oom=2")
    injector.before_forward()
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        injector.before_forward()
    injector.before_forward()  # only the second forward fails


# ---- the engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_engine_fault_mid_prefill(daemon, offline, sig):
    """The engine dies or hangs while it loads a cold adapter for a long prefill."""
    adapter = "all-r32" if sig == signal.SIGKILL else "mlp-r64"
    expected = offline(LONG_PROMPT, adapter, 8)
    pid, restarts = _engine(daemon)
    req = Streamer(daemon, LONG_PROMPT, adapter=adapter, max_tokens=8)
    _wait(lambda: _stats(daemon)["running"] >= 1, 30, "the prefill to start", interval_s=0.02)
    hit = time.monotonic()
    os.kill(pid, sig)
    try:
        req.finish()
        stats = _wait_replaced(daemon, pid, 5)
    finally:
        _reap(pid)
    req.check_exact(expected)
    assert req.chunks[0][0] > hit, "the fault did not land mid-prefill"
    assert stats["engine_restarts"] > restarts
    if sig == signal.SIGSTOP:  # noticed by its heartbeat, far before the 60 s step deadline
        assert req.chunks[0][0] - hit < 30 and "no heartbeat" in daemon.log()


@pytest.mark.parametrize("sig", [  # SIGKILL mid-decode: also test_daemon_e2e's engine-killed test
    pytest.param(signal.SIGKILL, id="sigkill", marks=pytest.mark.slow), pytest.param(signal.SIGSTOP, id="sigstop")])
def test_engine_fault_mid_decode(either_loop, offline, sig):
    daemon = either_loop
    expected = offline(DECODE_PROMPT, None, 20)
    pid, restarts = _engine(daemon)
    req = Streamer(daemon, DECODE_PROMPT, max_tokens=20)
    _wait(lambda: len(req.chunks) >= 5, 30, "five tokens", interval_s=0.01)
    hit = time.monotonic()
    os.kill(pid, sig)
    try:
        req.finish()
    finally:
        _reap(pid)
    req.check_exact(expected)
    assert any(t > hit for t, _ in req.chunks), "the request ended before the fault"
    stats = _wait_replaced(daemon, pid, 10)
    assert stats["engine_restarts"] > restarts
    if sig == signal.SIGSTOP:
        gap = max(b - a for (a, _), (b, _) in zip(req.chunks, req.chunks[1:]))
        assert gap < 30, f"a stopped engine took {gap:.1f} s to notice"


def test_idle_engine_that_hangs_is_replaced(daemon, offline):
    """No request outstanding: only the heartbeat can tell the engine is stopped."""
    pid, restarts = _engine(daemon)
    os.kill(pid, signal.SIGSTOP)
    try:
        stats = _wait_replaced(daemon, pid, 20)
    finally:
        _reap(pid)
    assert stats["engine_restarts"] == restarts + 1
    assert not _alive(pid)
    with daemon.client() as c:
        got = c.generate(DECODE_PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60)
    assert got.token_ids == offline(DECODE_PROMPT, None, 6)


def test_forward_that_raises_once_is_replanned_on_the_same_engine(either_loop, offline):
    daemon = either_loop
    expected = offline(DECODE_PROMPT, None, 12)
    pid, restarts = _engine(daemon)
    req = Streamer(daemon, DECODE_PROMPT, max_tokens=12)
    _wait(lambda: len(req.chunks) >= 3, 30, "three tokens", interval_s=0.01)
    _arm(daemon, "step_raise=1")
    req.finish().check_exact(expected)
    assert not daemon.fault_file.exists(), "the fault was never taken"
    assert _engine(daemon) == (pid, restarts)
    assert "injected fault" in daemon.log()


@pytest.mark.slow
def test_forward_that_keeps_raising_restarts_the_engine(daemon, offline):
    expected = offline(DECODE_PROMPT, None, 20)
    pid, restarts = _engine(daemon)
    req = Streamer(daemon, DECODE_PROMPT, max_tokens=20)
    _wait(lambda: len(req.chunks) >= 3, 30, "three tokens", interval_s=0.01)
    _arm(daemon, "step_raise=1x3")  # MAX_STEP_FAILURES in a row
    req.finish().check_exact(expected)
    assert _wait_replaced(daemon, pid, 10)["engine_restarts"] == restarts + 1
    assert "failed 3 steps in a row" in daemon.log()


def test_out_of_memory_shrinks_the_batch_and_keeps_the_engine(either_loop, offline):
    daemon = either_loop
    prompts = [[5 + i, 6, 7 + i] for i in range(4)]
    expected = [offline(p, None, 10) for p in prompts]
    pid, restarts = _engine(daemon)
    reqs = [Streamer(daemon, p, max_tokens=10) for p in prompts]
    _wait(lambda: all(len(r.chunks) >= 2 for r in reqs), 30, "all four decoding", interval_s=0.01)
    _arm(daemon, "step_oom=1")
    for req, exp in zip(reqs, expected):
        req.finish().check_exact(exp)
    assert _engine(daemon) == (pid, restarts), "an out-of-memory step must not cost the engine"
    # Four requests, or fewer if one finished before the fault came (steps run ahead with overlap).
    assert re.search(r"ran out of memory on a step of [234] requests; retrying with [12]\b", daemon.log())


def test_out_of_memory_of_a_lone_request_fails_it_with_a_typed_error(either_loop, offline):
    daemon = either_loop
    pid, restarts = _engine(daemon)
    req = Streamer(daemon, DECODE_PROMPT, max_tokens=30)
    _wait(lambda: len(req.chunks) >= 2, 30, "two tokens", interval_s=0.01)
    _arm(daemon, "step_oom=1")
    req.finish()
    assert req.error is not None and req.error.code.value == "overloaded", (req.error, req.result)
    assert "out of memory" in str(req.error)
    assert _engine(daemon) == (pid, restarts)
    with daemon.client() as c:
        got = c.generate(DECODE_PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60)
    assert got.token_ids == offline(DECODE_PROMPT, None, 6)


# ---- CPU workers, daemon death, shutdown under load -------------------------------------------

@pytest.fixture(scope="module")
def assisted(demo, tmp_path_factory):
    """cpu_assist with two workers; the last test of this file kills and restarts it."""
    proc = DaemonProcess(tmp_path_factory.mktemp("assist"), *_model_args(demo), "--adapter-load-mode", "cpu_assist",
                         "--cpu-workers", "2", env={"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "2e6", **SPARES}).start()
    yield proc
    for pid in getattr(proc, "stopped", []):
        _reap(pid)
    proc.stop()  # normally the last test has stopped it already


def _workers(daemon) -> list[dict]:
    return _stats(daemon)["cpu_assist"]["workers"]


@pytest.mark.parametrize("sig,adapter", [  # a worker's exit was already supervised; its silence is new
    pytest.param(signal.SIGKILL, "all-r32", id="sigkill", marks=pytest.mark.slow),
    pytest.param(signal.SIGSTOP, "mlp-r64", id="sigstop")])
def test_cpu_worker_fault_mid_prefill(assisted, offline, sig, adapter):
    expected = offline(LONG_PROMPT, adapter, 4)
    workers = _workers(assisted)
    victim = workers[0]["pid"]
    assisted.stopped = [*getattr(assisted, "stopped", []), victim]
    req = Streamer(assisted, LONG_PROMPT, adapter=adapter, max_tokens=4)
    _wait(lambda: _stats(assisted)["running"] >= 1, 30, "the prefill to start", interval_s=0.02)
    hit = time.monotonic()
    os.kill(victim, sig)
    req.finish().check_exact(expected)
    assert req.result.timings["adapter_path"] == "cpu_assisted"
    assert req.chunks[0][0] > hit, "the fault did not land mid-prefill"
    now = _wait(lambda: (w := _workers(assisted))[0]["pid"] != victim and all(x["ready"] for x in w) and w,
                20, "the worker to be replaced")
    assert now[0]["starts"] == workers[0]["starts"] + 1 and now[1]["pid"] == workers[1]["pid"]
    assert not _alive(victim)


def test_idle_cpu_worker_that_hangs_is_replaced(assisted):
    before = _workers(assisted)[1]
    assisted.stopped = [*getattr(assisted, "stopped", []), before["pid"]]
    os.kill(before["pid"], signal.SIGSTOP)
    now = _wait(lambda: (w := _workers(assisted)[1])["pid"] != before["pid"] and w["ready"] and w, 20,
                "the stopped idle worker to be replaced")
    assert now["stalls"] == before["stalls"] + 1 and not _alive(before["pid"])


def test_daemon_sigkill_then_restart_sweeps_and_sigterm_drains(assisted, offline):
    """The daemon dies: its children follow, those owning shared memory unlink it first; the next
    daemon on the same runtime directory sweeps the sockets left behind, serves, and drains on SIGTERM."""
    stats = _stats(assisted)
    children = [stats["engine"]["pid"]] + [w["pid"] for w in stats["cpu_assist"]["workers"]]
    children += [stats["engine"]["spare_pid"]] if stats["engine"]["spare_pid"] else []  # spares die with it too
    instance = assisted.instance
    assert _segments(instance), "cpu_assist should have created shared memory"
    assisted.proc.send_signal(signal.SIGKILL)
    assisted.proc.wait(10)
    _wait(lambda: not any(_alive(p) for p in children), 10, "the children to exit with the daemon")
    assert not _segments(instance), "the children of a SIGKILLed daemon left shared memory behind"
    assert list(assisted.runtime_dir.glob("*.sock")), "nothing was left to sweep"
    assisted.start()
    assert _stats(assisted)["engine"]["pid"] not in children
    # SIGTERM under load: everything in flight finishes, then exit 0 with nothing left behind.
    prompts = [[9 + i, 10, 11] for i in range(4)]
    accepted = _stats(assisted)["requests"]
    reqs = [Streamer(assisted, p, adapter="qv-r8" if i % 2 else None, max_tokens=12) for i, p in enumerate(prompts)]
    # All of them in (a request sent after SIGTERM is refused: draining), at least two still running.
    _wait(lambda: (s := _stats(assisted))["requests"] >= accepted + len(prompts) and s["running"] >= 2, 30,
          "requests accepted and running", interval_s=0.02)
    assisted.proc.send_signal(signal.SIGTERM)
    for i, (req, p) in enumerate(zip(reqs, prompts)):
        req.finish().check_exact(offline(p, "qv-r8" if i % 2 else None, 12))
    assert assisted.stop() == 0, assisted.log()
    assert not _segments(instance), "shared-memory segments left behind"
    assert not list(assisted.runtime_dir.glob("*.sock"))
