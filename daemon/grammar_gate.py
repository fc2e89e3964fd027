"""The structured-output gate: whether a guided request's grammar compiles within the server's
limits, decided before the request reaches a scheduler, and never in an engine's step.

A bounded pool of compile workers (daemon/grammar_link.py, gpu_engine/grammar_worker.py;
`server.grammar_compile_workers`, started when first needed) compiles each new grammar in a
process of its own, killed once it used `server.grammar_compile_timeout_s` of CPU time and
capped at `server.grammar_compile_memory_mb` of memory. The verdicts are cached by grammar (least recently used
out), so a repeated schema is answered at once, a refused one refused at once; concurrent
requests with one grammar share its compile. Nesting and size were bounded before
(ipc/guided.py). An engine compiles its own copy off its step once the request is admitted
to its queue (daemon/scheduler/grammar_book.py). Torch-free.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.config import ServerSettings
from loraplex.daemon.grammar_link import GrammarWorkerLink
from loraplex.daemon.rejected import Rejected
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.guided import grammar_key
from loraplex.ipc.protocol import GrammarCompile, GrammarCompiled

log = logging.getLogger("loraplex.daemon.grammar")
MAX_VERDICTS = 4096  # grammars whose verdict is remembered
MAX_COMPILING = 256  # distinct grammars waiting for a worker; more are `overloaded`
REPLY_GRACE_S = 10.0  # past its compile's wall bound, how long a worker may take to answer before it counts as hung
RETRY_START_S = 30.0  # after a worker failed to start, requests fail at once for this long
_CODES = {"invalid": ErrorCode.INVALID_FIELD, "too_complex": ErrorCode.GRAMMAR_TOO_COMPLEX}


@dataclass(frozen=True, slots=True)
class Verdict:
    """code None: the grammar compiles within the limits; else the request fails with code and message."""

    code: ErrorCode | None = None
    message: str = ""


ACCEPTED = Verdict()


class GrammarGate:
    def __init__(self, server: ServerSettings, make_link: Callable[[int], GrammarWorkerLink],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = server.grammar_compile_timeout_s
        self.memory_bytes = server.grammar_compile_memory_mb << 20
        self._links = [make_link(i) for i in range(server.grammar_compile_workers)]
        self._idle: asyncio.Queue[GrammarWorkerLink] = asyncio.Queue()
        for link in self._links:
            self._idle.put_nowait(link)
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._compiling: dict[str, asyncio.Future[Verdict]] = {}
        self._start_failure: tuple[float, str] | None = None  # (when, why) a worker last failed to start
        self._clock = clock
        self._stopped = False
        self.compiles = 0  # grammars compiled by a worker
        self.cache_hits = 0  # requests answered from the cache (or by a compile already under way)
        self.refused = 0  # verdicts other than accepted, each request counted
        self.max_compile_s = 0.0

    def known(self, kind: str, spec: str) -> bool:
        """Whether check() answers at once (no compile needed)."""
        return kind == "json_object" or grammar_key(kind, spec) in self._verdicts

    async def check(self, kind: str, spec: str) -> Verdict:
        """The verdict on (kind, spec), compiling it in a worker when it is new. Rejected(overloaded)
        when too many grammars already wait for a worker."""
        if kind == "json_object":  # one fixed grammar
            return ACCEPTED
        key = grammar_key(kind, spec)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
            self.cache_hits += 1
        else:
            compiling = self._compiling.get(key)
            if compiling is None:
                if len(self._compiling) >= MAX_COMPILING:
                    raise Rejected(ErrorCode.OVERLOADED, f"{len(self._compiling)} grammars are waiting to compile; "
                                                         "try again later")
                compiling = self._compiling[key] = asyncio.ensure_future(self._compile(key, kind, spec))
            else:
                self.cache_hits += 1
            verdict = await asyncio.shield(compiling)  # a request that gives up leaves the compile to the others
        self.refused += verdict.code is not None
        return verdict

    async def _compile(self, key: str, kind: str, spec: str) -> Verdict:
        try:
            verdict, remember = await self._run(kind, spec)
        finally:
            del self._compiling[key]
        if remember:
            self._verdicts[key] = verdict
            while len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
        return verdict

    async def _run(self, kind: str, spec: str) -> tuple[Verdict, bool]:
        """(the verdict, whether it is the grammar's own and may be cached) from the next free worker."""
        failure = self._start_failure
        if failure is not None and self._clock() - failure[0] < RETRY_START_S:
            return Verdict(ErrorCode.ENGINE_FAILED, failure[1]), False
        link = await self._idle.get()
        try:
            if self._stopped:
                return Verdict(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"), False
            if not link.alive():
                await link.start()
            order = GrammarCompile(kind=kind, spec=spec, timeout_s=self.timeout_s, memory_bytes=self.memory_bytes)
            reply = await link.call(order, timeout_s=order.wall_s + REPLY_GRACE_S)
        except (EngineDied, EngineRefused, OSError) as exc:
            if link.hello is None:  # it did not start (xgrammar missing, a bad model directory)
                self._start_failure = (self._clock(), f"structured output is unavailable: {exc}")
            log.error("grammar worker %d: %s", link.index, exc)
            return Verdict(ErrorCode.ENGINE_FAILED, f"the grammar compiler failed: {exc}"), False
        finally:
            self._idle.put_nowait(link)
        if not isinstance(reply, GrammarCompiled):
            return Verdict(ErrorCode.INTERNAL, f"the grammar compiler answered {reply.TYPE}"), False
        self.compiles += 1
        self.max_compile_s = max(self.max_compile_s, reply.seconds)
        if reply.verdict == "ok":
            return ACCEPTED, True
        log.info("%s refused (%s) after %.2f s: %s", kind, reply.verdict, reply.seconds, reply.message)
        return Verdict(_CODES[reply.verdict], reply.message), True

    async def stop(self) -> None:
        """Stop the workers; the compiles under way end (their requests were failed before)."""
        self._stopped = True
        for compiling in list(self._compiling.values()):
            compiling.cancel()
        for link in self._links:
            await link.stop()

    def snapshot(self) -> dict[str, object]:
        return {"compiles": self.compiles, "cache_hits": self.cache_hits, "refused": self.refused,
                "cached": len(self._verdicts), "compiling": len(self._compiling),
                "max_compile_s": self.max_compile_s, "timeout_s": self.timeout_s,
                "workers": [link.pid for link in self._links if link.alive()]}
