"""Structured output in the sampler: grammars compiled by xgrammar against the model's
tokenizer, and one matcher per guided request, advanced by the tokens the engine fed.

xgrammar was picked over llguidance by measured per-token mask time at batch 64 on the
CPU (bench/grammar_mask.py, bench/RESULTS.md). A matcher's state is a function of the
request's output tokens (gpu_engine.sampling_history), so a recompute after preemption,
restart or migration rebuilds it. Compiled grammars are cached by (kind, spec).

Compiling never runs in the step when the daemon orders it ahead (StepPlan.grammars):
`start` hands it to one background thread (xgrammar releases the GIL while it compiles, so
the step's thread runs on; tests/test_grammar_compile.py measures it) and `take_ready` says
which ended, for the step result; the daemon admits the request once it is listed. Its
time and memory limits were already checked by a killable process (gpu_engine/grammar_worker.py),
so this compile is bounded too. A grammar nobody ordered ahead (the offline API, a cache
eviction) is compiled when its row is first sampled. A grammar that does not compile fails
its row only, with the compiler's reason.
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.ipc.engine_plan import MAX_COMPILED_GRAMMARS, GrammarOrder, RowPlan
from loraplex.ipc.guided import grammar_key

MAX_COMPILED = MAX_COMPILED_GRAMMARS
COMPILE_NICE = 10  # the background compile thread yields the CPU to the step's threads (nice is per thread)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[time] file.cc:line: " before the reason


class GrammarError(ValueError):
    """A guided request whose grammar cannot be used; the message says why."""


class GrammarTooLarge(GrammarError):
    """The compiler ran out of memory (an address-space limit, gpu_engine/grammar_worker.py)."""


@dataclass(slots=True)
class _State:
    key: tuple[str, str]
    matcher: object  # xgrammar.GrammarMatcher
    consumed: list[int]


def _nice_thread() -> None:
    try:
        os.nice(COMPILE_NICE)
    except OSError:
        pass


class Grammars:
    """Compiles grammars and keeps the matchers of guided requests (bounded, least recently used out)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...], *,
                 max_requests: int = 4096) -> None:
        import xgrammar as xgr
        from tokenizers import Tokenizer

        self._xgr = xgr
        tok = Tokenizer.from_file(str(tokenizer_json))
        vocab = tok.get_vocab(with_added_tokens=True)
        encoded = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            encoded[i] = token
        # The HF-tokenizer detection xgrammar runs on transformers tokenizers, applied to tokenizer.json.
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        info = xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=list(eos_token_ids) or None, add_prefix_space=meta["add_prefix_space"])
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._failed: OrderedDict[tuple[str, str], str] = OrderedDict()  # why, for grammars that did not compile
        self._pending: dict[tuple[str, str], Future] = {}  # compiling in the background
        self._ready: list[str] = []  # grammar keys whose background compile ended, not yet reported
        self._pool: ThreadPoolExecutor | None = None  # started with the first background compile
        self._states: OrderedDict[str, _State] = OrderedDict()
        self.max_requests = max_requests

    def start(self, orders: list[GrammarOrder]) -> None:
        """Compile these off the step; each is reported by `take_ready` once its compile ended."""
        for order in orders:
            key = (order.kind, order.spec)
            if key in self._compiled or key in self._failed:
                self._ready.append(grammar_key(*key))
            elif key not in self._pending:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile", initializer=_nice_thread)
                self._pending[key] = self._pool.submit(self.compile_now, *key)

    def take_ready(self) -> list[str]:
        """The keys (ipc.guided.grammar_key) of the ordered grammars whose compile ended since the
        last call, compiled or not; their results join the caches here, on the step's thread."""
        for key in [k for k, future in self._pending.items() if future.done()]:
            self._settle(key, self._pending.pop(key))
            self._ready.append(grammar_key(*key))
        ready, self._ready = self._ready, []
        return ready

    def compile(self, kind: str, spec: str):
        """The compiled grammar of (kind, spec), compiled now if nobody ordered it ahead (or waiting
        for its background compile); GrammarError with the reason when it has none."""
        key = (kind, spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        if key in self._failed:
            raise GrammarError(self._failed[key])
        future = self._pending.pop(key, None)
        if future is not None:  # ordered ahead, still compiling: wait for it (and report it, as take_ready would)
            try:
                return self._settle(key, future)
            finally:
                self._ready.append(grammar_key(kind, spec))
        # Through the one compile thread when there is one: the compiler is not shared between threads.
        future = self._pool.submit(self.compile_now, kind, spec) if self._pool is not None else _run(
            self.compile_now, kind, spec)
        return self._settle(key, future)

    def _settle(self, key: tuple[str, str], future: Future):
        """A finished compile into the caches (least recently used out): the grammar, or its error raised."""
        try:
            compiled = future.result()
        except GrammarError as exc:
            self._failed[key] = str(exc)
            while len(self._failed) > MAX_COMPILED:
                self._failed.popitem(last=False)
            raise
        self._compiled[key] = compiled
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def compile_now(self, kind: str, spec: str):
        """Compile (kind, spec) in this thread, no cache; GrammarError (GrammarTooLarge when out of memory)."""
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI means it (xgrammar's built-in JSON takes any value)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                choices = json.loads(spec)
                return self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        except MemoryError:
            raise GrammarTooLarge(f"{kind}: out of memory while compiling") from None
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the reason
            reason = _LOG_PREFIX.sub("", str(exc).strip())[:1000]
            if "bad_alloc" in reason:
                raise GrammarTooLarge(f"{kind}: out of memory while compiling") from None
            raise GrammarError(f"{kind}: {reason}") from None
        raise GrammarError(f"unknown guided kind {kind!r}")

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def fill(self, row: RowPlan, outputs: list[int], bitmask: torch.Tensor, index: int) -> None:
        """Write into bitmask[index] the tokens the row's grammar allows after `outputs`."""
        spec = row.sampling
        key = (spec.guided_kind, spec.guided_spec)
        state = self._states.get(row.request_id)
        if state is None or state.key != key or state.consumed != outputs[: len(state.consumed)]:
            state = _State(key, self._xgr.GrammarMatcher(self.compile(*key)), [])  # new, or recomputed otherwise
            self._states[row.request_id] = state
        self._states.move_to_end(row.request_id)
        while len(self._states) > self.max_requests:
            self._states.popitem(last=False)
        for token in outputs[len(state.consumed):]:
            if state.matcher.is_terminated():
                break  # only EOS was allowed; ignore_eos keeps sampling it
            if not state.matcher.accept_token(token):
                raise GrammarError(f"token {token} does not follow the grammar")
            state.consumed.append(token)
        if state.matcher.is_terminated():  # the grammar is complete: EOS only
            bitmask[index] = 0
            for eos in self.eos_token_ids:
                bit = 1 << (eos % 32)
                bitmask[index, eos // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
            return
        state.matcher.fill_next_token_bitmask(bitmask, index)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask, in place, the disallowed tokens of logits[rows] ([S, vocab])."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=rows)

    def allocate(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)


def _run(fn, *args) -> Future:
    """fn(*args) as a finished future (its result or its exception)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:
        future.set_exception(exc)
    return future
