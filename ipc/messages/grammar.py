"""Messages between the daemon and a grammar compile worker (`loraplex-grammar`, private socket).

Owns the declarations only: the worker's hello, one compile order and its verdict. The
order is compiled to learn whether it compiles within the limits it carries; no compiled
grammar travels (the engine compiles its own copy off the step, gpu_engine/grammar.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from loraplex.ipc.engine_plan import MAX_GUIDED_SPEC
from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import InInterval, InRange, Length

MAX_COMPILE_TIMEOUT_S = 3600.0
MAX_COMPILE_MEMORY_BYTES = 1 << 44
MAX_VERDICT_MESSAGE_LEN = 2000


@register
@dataclass(frozen=True, slots=True)
class GrammarWorkerHello(Message):
    """First message of a started compile worker: the vocabulary it compiles against."""

    TYPE = "grammar_worker_hello"
    pid: int
    vocab_size: int


@register
@dataclass(frozen=True, slots=True)
class GrammarCompile(Message):
    """Compile (kind, spec) in a process of its own, killed once it used `timeout_s` of CPU time
    (or `wall_s` passed: a host too busy to give it that), its address space bounded to
    `memory_bytes` more than the worker's."""

    TYPE = "grammar_compile"
    kind: Literal["json_schema", "json_object", "regex", "choice"]
    spec: Annotated[str, Length(0, MAX_GUIDED_SPEC)]
    timeout_s: Annotated[float, InInterval(0.0, MAX_COMPILE_TIMEOUT_S, lo_open=True)]
    memory_bytes: Annotated[int, InRange(1, MAX_COMPILE_MEMORY_BYTES)]

    @property
    def wall_s(self) -> float:
        """The wall-clock bound of the compile: CPU time, not a busy host, decides the verdict."""
        return 4 * self.timeout_s + 5.0


@register
@dataclass(frozen=True, slots=True)
class GrammarCompiled(Message):
    """ok: compiled within the limits; invalid: the compiler refused it (message: why);
    too_complex: past the time or memory limit, or it crashed the compiler (message: which)."""

    TYPE = "grammar_compiled"
    verdict: Literal["ok", "invalid", "too_complex"]
    message: Annotated[str, Length(0, MAX_VERDICT_MESSAGE_LEN)] = ""
    seconds: Annotated[float, InInterval(0.0, MAX_COMPILE_TIMEOUT_S * 8)] = 0.0  # wall clock
