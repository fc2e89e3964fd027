"""Per-request token sampling: logits processing (bias, min_tokens, penalties),
greedy, temperature, top-k, top-p, seeded; logprobs and top-k alternatives.

Stateless in its randomness: the random stream for token k of a request is
derived from (seed, k), so a request recomputed after preemption or an engine
restart draws the same tokens. The penalties read the tokens the engine fed
(gpu_engine.sampling_history), which a recompute rebuilds. Logprobs and
alternatives are of the model's unmodified distribution (vLLM's default).
Rows without these options pay nothing for them.

A row's numbers never fail the step: a temperature below SAMPLING_EPS samples greedily, and
one vectorised check per step (fetched with the greedy tokens) fails each row whose logits
hold NaN or +inf or whose options mask every token, with `sampling_error`; a sampled row's
probabilities are checked where they already are on the host. A step whose sampling raises
is sampled again in halves (gpu_engine.row_isolation): a row that raises alone fails alone.
"""
from __future__ import annotations

from pathlib import Path

import torch

from loraplex.gpu_engine.row_isolation import bisect_failures
from loraplex.gpu_engine.sampling_history import SamplingHistory
from loraplex.ipc.engine_plan import GrammarOrder, RowPlan, RowResult, SamplingSpec
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.guided import grammar_key

_MASK64 = (1 << 64) - 1
# torch.OutOfMemoryError since 2.5; torch.cuda.OutOfMemoryError (its alias now) before: never isolated.
_OOM_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
_SAMPLING_ERROR = ErrorCode.SAMPLING_ERROR.value
# What the per-step check finds in a row (its verdict): nothing, a NaN or +inf logit, every token masked.
_SOUND, _NON_FINITE, _NOTHING_LEFT = 0, 1, 2


def stream_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): independent streams for consecutive tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _filtered_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    # logits: [vocab] float32
    scaled = logits / spec.temperature
    if 0 < spec.top_k < scaled.numel():
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= spec.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def _verdicts(logits: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    """Per row [rows] int64: _SOUND, _NON_FINITE (NaN or +inf in the raw or processed logits) or
    _NOTHING_LEFT (every processed logit -inf), computed on the logits' device without a sync."""
    def non_finite(x: torch.Tensor) -> torch.Tensor:
        return (torch.isnan(x) | torch.isposinf(x)).any(dim=-1)

    bad = non_finite(processed) if processed is logits else non_finite(logits) | non_finite(processed)
    empty = torch.isneginf(processed).all(dim=-1)
    return torch.where(bad, _NON_FINITE, torch.where(empty, _NOTHING_LEFT, _SOUND))


def _why(verdict: int, spec: SamplingSpec) -> str:
    if verdict == _NON_FINITE:
        return ("the logits of this request hold NaN or +inf (a repetition_penalty near 0 divides them "
                "to inf; or the model's numbers overflowed)")
    if spec.guided_kind:
        return "no token is allowed: the grammar conflicts with logit_bias or min_tokens"
    return "no token is allowed: min_tokens, stop_token_ids and logit_bias mask the whole vocabulary"


def _usable(probs: torch.Tensor) -> bool:
    """A sampled row's probabilities (on the host) can be drawn from."""
    return bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0.0


class Sampler:
    """Samples one token per sampling row of a step; owns the penalised rows' token history."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = (), *,
                 history: SamplingHistory | None = None, tokenizer_json: Path | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.history = history if history is not None else SamplingHistory()
        self.tokenizer_json = tokenizer_json  # the vocabulary guided rows are compiled against
        self._grammars = None  # gpu_engine.grammar.Grammars, built with the first guided row
        self._unusable: list[str] = []  # grammars ordered while there is no grammar library: ready, to fail

    def forget(self, request_ids: list[str]) -> None:
        """These requests left the engine's batch: drop their token history and grammar state."""
        if request_ids:
            self.history.forget(request_ids)
            if self._grammars is not None:
                self._grammars.forget(request_ids)

    @property
    def grammars(self):
        """The grammar compiler and matchers (xgrammar is imported only when a row is guided)."""
        if self._grammars is None:
            from loraplex.gpu_engine.grammar import GrammarError, Grammars

            if self.tokenizer_json is None or not self.tokenizer_json.is_file():
                raise GrammarError("structured output needs the model's tokenizer.json")
            try:
                self._grammars = Grammars(self.tokenizer_json, self.vocab_size, self.eos_token_ids,
                                          max_requests=self.history.max_requests)
            except ImportError:
                raise GrammarError("structured output needs xgrammar (pip install 'loraplex[engine]')") from None
        return self._grammars

    def compile_ahead(self, orders: list[GrammarOrder]) -> None:
        """Compile these grammars off the step (gpu_engine/grammar.py); with no grammar library they
        are ready at once, and their rows fail with why."""
        from loraplex.gpu_engine.grammar import GrammarError

        try:
            self.grammars.start(orders)
        except GrammarError:
            self._unusable += [grammar_key(o.kind, o.spec) for o in orders]

    def grammars_ready(self) -> list[str]:
        """The ordered grammars whose compile ended since the last step (StepResult.grammars_ready)."""
        ready, self._unusable = self._unusable, []
        return ready + self._grammars.take_ready() if self._grammars is not None else ready

    def sample(self, logits: torch.Tensor, rows: list[RowPlan], sampled: list[RowPlan]) -> list[RowResult]:
        """logits: [len(sampled), vocab] float32 for the `sampled` rows (a subset of `rows`, the step's rows,
        which all feed the history) -> one RowResult per sampled row."""
        for row in rows:
            if row.sampling.needs_history:
                self.history.feed(row)
        try:
            return self._sample(logits, sampled)
        except _OOM_ERRORS:
            raise
        except Exception as exc:  # a row that raises alone fails alone; every row raising is ours
            indexed = list(enumerate(sampled))
            parts, guilty = bisect_failures(
                lambda part: self._sample(logits[[i for i, _ in part]], [row for _, row in part]), indexed, exc,
                _OOM_ERRORS)
        by_id = {r.request_id: r for part in parts for r in part}
        by_id.update({row.request_id: RowResult(request_id=row.request_id, token_id=0, logprob=None,
                                                error=f"sampling this request raised: {err}",
                                                error_code=_SAMPLING_ERROR) for (_, row), err in guilty})
        return [by_id[row.request_id] for row in sampled]

    def _sample(self, logits: torch.Tensor, sampled: list[RowPlan]) -> list[RowResult]:
        """The sampled rows (their history fed) -> one RowResult each."""
        logprobs = torch.log_softmax(logits, dim=-1)
        processed = logits
        for i, row in enumerate(sampled):
            if row.sampling.processes_logits:
                if processed is logits:
                    processed = logits.clone()
                processed[i] = self._process(logits[i], row)
        errors = {i: (ErrorCode.INVALID_FIELD.value, why) for i, why in self._guide(processed, sampled).items()} \
            if any(r.sampling.guided_kind for r in sampled) else {}
        # One transfer for the greedy tokens and every row's verdict: no sync per row.
        greedy, verdicts = torch.stack((torch.argmax(processed, dim=-1), _verdicts(logits, processed))).tolist()
        tokens: list[int] = []
        for i, row in enumerate(sampled):
            spec = row.sampling
            if i not in errors and verdicts[i] != _SOUND:
                errors[i] = (_SAMPLING_ERROR, _why(verdicts[i], spec))
            if i in errors:
                tokens.append(0)  # never used: the row fails
                continue
            if spec.greedy:
                tokens.append(greedy[i])
                continue
            probs = _filtered_probs(processed[i], spec).cpu()
            if not _usable(probs):  # finite logits, yet e.g. scaled past float range: this row alone fails
                errors[i] = (_SAMPLING_ERROR, "the sampling probabilities of this request are not finite")
                tokens.append(0)
                continue
            gen = torch.Generator(device="cpu").manual_seed(stream_seed(spec.seed, row.sample_index))
            tokens.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        top = self._top(logprobs, sampled)
        return [RowResult(request_id=row.request_id, token_id=t,
                          logprob=lp if (row.sampling.logprobs or row.sampling.top_logprobs) and i not in errors
                          else None, top_ids=top[i][0] if i not in errors else [],
                          top_logprobs=top[i][1] if i not in errors else [],
                          error=errors[i][1] if i in errors else "", error_code=errors[i][0] if i in errors else "")
                for i, (row, t, lp) in enumerate(zip(sampled, tokens, picked))]

    def _guide(self, processed: torch.Tensor, sampled: list[RowPlan]) -> dict[int, str]:
        """Mask, in place, what each guided row's grammar forbids; the rows that cannot be sampled, with why."""
        from loraplex.gpu_engine.grammar import GrammarError

        guided = [i for i, row in enumerate(sampled) if row.sampling.guided_kind]
        errors: dict[int, str] = {}
        try:
            grammars = self.grammars
        except GrammarError as exc:
            return {i: str(exc) for i in guided}
        bitmask = grammars.allocate(len(sampled))
        masked = []
        for i in guided:
            context, out_start = self.history.split(sampled[i])
            try:
                grammars.fill(sampled[i], context[out_start:].tolist(), bitmask, i)
                masked.append(i)
            except GrammarError as exc:
                errors[i] = str(exc)
        if masked:  # a row its grammar leaves no token fails in the per-step check (_verdicts)
            grammars.apply(processed, bitmask, masked)
        return errors

    def _process(self, logits: torch.Tensor, row: RowPlan) -> torch.Tensor:
        """One row's logits [vocab] after bias, min_tokens and penalties (SamplingSpec's order)."""
        spec = row.sampling
        x = logits.clone()
        device = x.device
        if spec.logit_bias_ids:
            ids = torch.tensor(spec.logit_bias_ids, dtype=torch.int64)
            keep = ids < self.vocab_size  # the daemon refuses others; never index out of range here
            x.index_put_((ids[keep].to(device),),
                         torch.tensor(spec.logit_bias_values, dtype=x.dtype)[keep].to(device), accumulate=True)
        if row.sample_index < spec.min_tokens:
            banned = [t for t in spec.stop_token_ids if 0 <= t < self.vocab_size]
            if not spec.ignore_eos:
                banned += self.eos_token_ids
            if banned:
                x[torch.tensor(banned, dtype=torch.int64, device=device)] = float("-inf")
        if spec.penalised:
            context, out_start = self.history.split(row)
            ids = torch.frombuffer(context, dtype=torch.int32).to(torch.int64) if len(context) else \
                torch.zeros(0, dtype=torch.int64)
            counts = torch.bincount(ids[out_start:], minlength=self.vocab_size)[: self.vocab_size]
            counts = counts.to(device=device, dtype=x.dtype)
            if spec.repetition_penalty != 1.0:
                seen = torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size].to(device) > 0
                x = torch.where(seen, torch.where(x > 0, x / spec.repetition_penalty, x * spec.repetition_penalty), x)
            x = x - spec.frequency_penalty * counts - spec.presence_penalty * (counts > 0).to(x.dtype)
        return x

    @staticmethod
    def _top(logprobs: torch.Tensor, sampled: list[RowPlan]) -> list[tuple[list[int], list[float]]]:
        """Each row's top_logprobs alternatives, one topk for the whole step."""
        out: list[tuple[list[int], list[float]]] = [([], [])] * len(sampled)
        want = [(i, row.sampling.top_logprobs) for i, row in enumerate(sampled) if row.sampling.top_logprobs > 0]
        if not want:
            return out
        k = min(max(n for _, n in want), logprobs.shape[1])
        index = torch.tensor([i for i, _ in want], dtype=torch.int64, device=logprobs.device)
        values, ids = torch.topk(logprobs.index_select(0, index), k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for j, (i, n) in enumerate(want):
            out[i] = (ids[j][:n], values[j][:n])
        return out
