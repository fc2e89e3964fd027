"""The grammar compile worker (`loraplex-grammar`): says whether a structured-output grammar
compiles against the model's tokenizer within the server's limits, off every engine's step.

A child of the daemon like the cache manager (gpu_engine/child_process.py: heartbeats, dies
with the daemon), started when the first guided request needs it. It imports xgrammar (which
imports torch, so this cannot run in the daemon) and builds the tokenizer's vocabulary once;
each compile then runs in a process forked for it, at low priority, its address space capped
at the worker's plus the order's `memory_bytes` (RLIMIT_AS) and killed once it used `timeout_s`
of CPU time (a busy host slows a compile but does not change its verdict; a wall-clock bound,
GrammarCompile.wall_s, backs that up): a runaway compile costs one killed process, never the
worker or an engine. Only the verdict travels back (ipc/messages/grammar.py): a compiled
grammar's serialized form is often far larger and slower to load than compiling it again, so an
engine compiles its own copy off its step once the daemon knows it is within the limits
(gpu_engine/grammar.py).
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import time
import traceback
from pathlib import Path

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.gpu_engine.child_process import run_child
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineFailure, EngineShutdown, GrammarCompile, GrammarCompiled, GrammarWorkerHello
from loraplex.ipc.sockets import TypedSocket

ROLE = "loraplex-grammar"
COMPILE_NICE = 10  # the compile yields the CPU to the engines and the daemon
CPU_CHECK_S = 0.05  # how often the worker reads its compile's CPU time
_PR_SET_PDEATHSIG = 1
_MAX_FD = 1 << 16
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class GrammarWorker:
    def __init__(self, spec: EngineSpec) -> None:
        model_dir = _model_dir(spec)
        config = ModelConfig.from_dir(model_dir)
        from loraplex.gpu_engine.grammar import Grammars

        try:  # as the engine's sampler builds them (gpu_engine/sampler.py): the same vocabulary and stop tokens
            self.grammars = Grammars(model_dir / "tokenizer.json", config.vocab_size, tuple(
                t for t in config.eos_token_ids if 0 <= t < config.vocab_size))
        except ImportError as exc:
            raise RuntimeError(f"structured output needs xgrammar (pip install 'loraplex[engine]'): {exc}") from None
        self.vocab_size = config.vocab_size

    def hello(self) -> GrammarWorkerHello:
        return GrammarWorkerHello(pid=os.getpid(), vocab_size=self.vocab_size)

    def compile(self, order: GrammarCompile) -> GrammarCompiled:
        """Compile `order` in a forked process within its limits; the verdict."""
        read_fd, write_fd = os.pipe()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: compile, write the verdict, exit (never returns)
            try:
                os.close(read_fd)
                _compile_in_child(self.grammars, order, write_fd)
            finally:
                os._exit(0)
        os.close(write_fd)
        try:
            data, limit = _watch(read_fd, pid, order.timeout_s, started + order.wall_s)
        finally:
            os.close(read_fd)
        if limit:
            _kill(pid)
        _, status = os.waitpid(pid, 0)
        seconds = time.monotonic() - started
        if limit == "cpu":
            return GrammarCompiled(verdict="too_complex", seconds=seconds, message=(
                f"the {order.kind} did not compile within {order.timeout_s:g} s (server.grammar_compile_timeout_s)"))
        if limit == "wall":
            return GrammarCompiled(verdict="too_complex", seconds=seconds, message=(
                f"the {order.kind} did not compile within {order.wall_s:g} s on a busy host "
                f"({order.timeout_s:g} s of CPU time, server.grammar_compile_timeout_s)"))
        try:
            verdict = json.loads(data)
            return GrammarCompiled(verdict=verdict["verdict"], message=verdict["message"][:1000], seconds=seconds)
        except (ValueError, KeyError, TypeError):  # it died before writing: a crash or the kernel's OOM kill
            why = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {os.WEXITSTATUS(status)}"
            return GrammarCompiled(verdict="too_complex", seconds=seconds,
                                   message=f"the {order.kind} crashed the grammar compiler ({why})")


def _model_dir(spec: EngineSpec) -> Path:
    """The engines' model directory (gpu_engine/runtime.py resolves the built-in demo the same way)."""
    if spec.model is not None:
        return Path(spec.model)
    from loraplex.gpu_engine.demo import builtin_demo

    return Path(builtin_demo().model_dir)


def _compile_in_child(grammars, order: GrammarCompile, write_fd: int) -> None:
    from loraplex.gpu_engine.grammar import GrammarError, GrammarTooLarge

    os.closerange(3, write_fd)  # the daemon's sockets and the heartbeat pipe are the worker's, not ours
    os.closerange(write_fd + 1, _MAX_FD)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the worker killed: so are we
        os.nice(COMPILE_NICE)
    except (OSError, AttributeError):
        pass
    limit = _address_space() + order.memory_bytes
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # already lower: that one holds
        pass
    try:
        grammars.compile_now(order.kind, order.spec)
        verdict, message = "ok", ""
    except GrammarTooLarge:
        verdict, message = "too_complex", (f"the {order.kind} needs more than {order.memory_bytes >> 20} MiB to "
                                           "compile (server.grammar_compile_memory_mb)")
    except GrammarError as exc:
        verdict, message = "invalid", str(exc)
    except MemoryError:
        verdict, message = "too_complex", (f"the {order.kind} needs more than {order.memory_bytes >> 20} MiB to "
                                           "compile (server.grammar_compile_memory_mb)")
    out = json.dumps({"verdict": verdict, "message": message}).encode()
    while out:
        out = out[os.write(write_fd, out):]


def _address_space() -> int:
    """This process's virtual size in bytes (what RLIMIT_AS counts)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _watch(fd: int, pid: int, cpu_s: float, deadline: float) -> tuple[bytes, str]:
    """What the child writes until it closes the pipe, and "" ; or what it wrote so far and which
    limit came first: "cpu" (it used `cpu_s` of CPU time) or "wall" (`deadline` passed)."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), "wall"
        readable, _, _ = select.select([fd], [], [], min(left, CPU_CHECK_S))
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks), ""
            chunks.append(chunk)
        elif _cpu_seconds(pid) >= cpu_s:
            return b"".join(chunks), "cpu"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live child (0 where /proc cannot tell: the wall bound holds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return 0.0


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(worker: GrammarWorker, sock: TypedSocket, demo: bool) -> None:
    sock.send(worker.hello())
    while True:
        msg = sock.recv().message
        if isinstance(msg, EngineShutdown):
            return
        if not isinstance(msg, GrammarCompile):
            sock.send(EngineFailure(code=ErrorCode.UNKNOWN_TYPE.value,
                                    message=f"grammar worker cannot handle {msg.TYPE}"))
            continue
        try:
            reply = worker.compile(msg)
        except Exception as exc:  # e.g. fork refused: this order fails, the worker goes on
            traceback.print_exc()
            reply = EngineFailure(code=ErrorCode.INTERNAL.value, message=f"grammar worker failed: {exc}")
        sock.send(reply)


def main(argv: list[str] | None = None) -> int:
    return run_child(ROLE, "grammar compiler", argv, GrammarWorker, serve)


if __name__ == "__main__":
    raise SystemExit(main())
