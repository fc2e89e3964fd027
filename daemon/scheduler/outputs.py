"""Sampled tokens into sequences (torch-free): recording a step's token, its log-probabilities
and the time of a request's first token, and the stop rules (a stop or EOS token, max_tokens,
the context length) that say when and why a sequence finishes.

It only writes a sequence's outputs: taking a finished sequence out of the batch (its pages, its
adapter) is the scheduler's (base.py).
"""
from __future__ import annotations

from typing import Callable

from loraplex.daemon.scheduler.estimators import OutputLengthPredictor
from loraplex.daemon.scheduler.sequence import Sequence
from loraplex.ipc.engine_plan import RowResult


class TokenRecorder:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, predictor: OutputLengthPredictor,
                 clock: Callable[[], float]) -> None:
        self._eos = frozenset(eos_token_ids)
        self._max_model_len = max_model_len
        self._predictor = predictor  # learns output lengths from the sequences that finish
        self._clock = clock

    def append(self, seq: Sequence, out: RowResult) -> str | None:
        """A step sampled `out` for `seq`: it becomes its next output token. Returns why `seq`
        finishes on it (None: it goes on)."""
        self._stamp_first(seq)
        seq.output_ids.append(out.token_id)
        seq.logprobs.append(out.logprob)
        if out.top_ids:
            seq.top_logprobs.append(dict(zip(out.top_ids, out.top_logprobs)))
        return self._learn(seq, self.finish_reason(seq, out.token_id))

    def resolved(self, seq: Sequence, index: int) -> str | None:
        """A launched step's token came and took its placeholder at output `index`. Returns why
        `seq` finishes on it; if it does, the placeholders after it go (its rows in the plans
        launched since were wasted)."""
        self._stamp_first(seq)
        reason = self.finish_reason(seq, seq.output_ids[index], index + 1)
        if reason is not None:
            del seq.output_ids[index + 1:], seq.logprobs[index + 1:]
        return self._learn(seq, reason)

    def _stamp_first(self, seq: Sequence) -> None:
        if seq.first_token_at is None:
            seq.first_token_at = self._clock()

    def _learn(self, seq: Sequence, reason: str | None) -> str | None:
        """A sequence that finishes teaches the predictor its output length."""
        if reason is not None:
            self._predictor.observe(seq.req.adapter, len(seq.output_ids))
        return reason

    def reached_length(self, seq: Sequence) -> bool:
        """Launched steps already gave it its last token (max_tokens or the context): a finish
        known in advance, so it is not planned again (a no-op without launched steps)."""
        return len(seq.output_ids) >= seq.req.max_tokens or seq.num_tokens >= self._max_model_len

    def finish_reason(self, seq: Sequence, token: int, produced: int | None = None) -> str | None:
        """Why `seq` finishes on `token`, its `produced`-th output (default: its last one), if it does."""
        req = seq.req
        if token in req.stop_token_ids or (not req.ignore_eos and token in self._eos):
            return "stop"
        produced = len(seq.output_ids) if produced is None else produced
        if produced >= req.max_tokens or len(req.prompt_ids) + produced >= self._max_model_len:
            return "length"
        return None
