"""Structured output in the sampler: grammars compiled by xgrammar against the model's
tokenizer, and one matcher per guided request, advanced by the tokens the engine fed.

xgrammar was picked over llguidance by measured per-token mask time at batch 64 on the
CPU (bench/grammar_mask.py, bench/RESULTS.md). A matcher's state is a function of the
request's output tokens (gpu_engine.sampling_history), so a recompute after preemption,
restart or migration rebuilds it. Compiled grammars are cached by (kind, spec). A grammar
that does not compile fails its row only, with the compiler's reason.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.ipc.engine_plan import RowPlan

MAX_COMPILED = 256
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[time] file.cc:line: " before the reason


class GrammarError(ValueError):
    """A guided request whose grammar cannot be used; the message says why."""


@dataclass(slots=True)
class _State:
    key: tuple[str, str]
    matcher: object  # xgrammar.GrammarMatcher
    consumed: list[int]


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
        self._states: OrderedDict[str, _State] = OrderedDict()
        self.max_requests = max_requests

    def compile(self, kind: str, spec: str):
        """The compiled grammar of (kind, spec); GrammarError with the reason when it has none."""
        key = (kind, spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        try:
            if kind == "json_schema":
                compiled = self._compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "json_object":  # an object, as OpenAI means it (xgrammar's built-in JSON takes any value)
                compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(spec)
            elif kind == "choice":
                choices = json.loads(spec)
                compiled = self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
            else:
                raise GrammarError(f"unknown guided kind {kind!r}")
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the reason
            raise GrammarError(f"{kind}: {_LOG_PREFIX.sub('', str(exc).strip())[:1000]}") from None
        self._compiled[key] = compiled
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

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
