"""Per-request token sampling: logits processing (bias, min_tokens, penalties),
greedy, temperature, top-k, top-p, seeded; logprobs and top-k alternatives.

Stateless in its randomness: the random stream for token k of a request is
derived from (seed, k), so a request recomputed after preemption or an engine
restart draws the same tokens. The penalties read the tokens the engine fed
(gpu_engine.sampling_history), which a recompute rebuilds. Logprobs and
alternatives are of the model's unmodified distribution (vLLM's default).
Rows without these options pay nothing for them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from loraplex.gpu_engine.sampling_history import SamplingHistory
from loraplex.ipc.engine_plan import RowPlan, RowResult, SamplingSpec

_MASK64 = (1 << 64) - 1


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


class Sampler:
    """Samples one token per sampling row of a step; owns the penalised rows' token history."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = (), *,
                 history: SamplingHistory | None = None, tokenizer_json: Path | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.history = history if history is not None else SamplingHistory()
        self.tokenizer_json = tokenizer_json  # the vocabulary guided rows are compiled against
        self._grammars = None  # gpu_engine.grammar.Grammars, built with the first guided row

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

    def sample(self, logits: torch.Tensor, rows: list[RowPlan], sampled: list[RowPlan]) -> list[RowResult]:
        """logits: [len(sampled), vocab] float32 for the `sampled` rows (a subset of `rows`, the step's rows,
        which all feed the history) -> one RowResult per sampled row."""
        for row in rows:
            if row.sampling.needs_history:
                self.history.feed(row)
        logprobs = torch.log_softmax(logits, dim=-1)
        processed = logits
        for i, row in enumerate(sampled):
            if row.sampling.processes_logits:
                if processed is logits:
                    processed = logits.clone()
                processed[i] = self._process(logits[i], row)
        errors = self._guide(processed, sampled) if any(r.sampling.guided_kind for r in sampled) else {}
        greedy = torch.argmax(processed, dim=-1).tolist()
        tokens: list[int] = []
        for i, row in enumerate(sampled):
            spec = row.sampling
            if i in errors:
                tokens.append(0)  # never used: the row fails
                continue
            if spec.temperature == 0.0 or spec.top_k == 1:
                tokens.append(greedy[i])
                continue
            probs = _filtered_probs(processed[i], spec).cpu()
            gen = torch.Generator(device="cpu").manual_seed(stream_seed(spec.seed, row.sample_index))
            tokens.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        top = self._top(logprobs, sampled)
        return [RowResult(request_id=row.request_id, token_id=t,
                          logprob=lp if row.sampling.logprobs or row.sampling.top_logprobs else None,
                          top_ids=top[i][0], top_logprobs=top[i][1], error=errors.get(i, ""))
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
        if masked:
            grammars.apply(processed, bitmask, masked)
            dead = torch.isneginf(processed[masked]).all(dim=-1).tolist()
            errors.update({i: "no token is allowed: the grammar conflicts with logit_bias or min_tokens"
                           for i, d in zip(masked, dead) if d})
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
