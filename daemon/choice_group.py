"""The n completions of one generate (OpenAI's n): the daemon runs them as sibling
requests (each its own sequence and seed) and answers with one `done` for all.

Owns the siblings' keys, what each finished with, and the merged reply. Sibling 0
keeps the request's own key (so cancel and duplicate checks find it); sibling i
gets `key + " " + str(i)`, which no client request id can produce (ids have no
spaces). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.ipc.protocol import ChoiceOutcome, DoneReply

MAX_SEED = (1 << 63) - 1


def sibling_key(key: str, index: int) -> str:
    return key if index == 0 else f"{key} {index}"


def sibling_seed(seed: int | None, index: int) -> int | None:
    """Choice i of a seeded request samples with seed + i (vLLM's rule): distinct, reproducible."""
    return None if seed is None else (seed + index) & MAX_SEED


@dataclass(slots=True)
class ChoiceGroup:
    key: str
    n: int
    done: dict[int, DoneReply] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [sibling_key(self.key, i) for i in range(self.n)]

    def finished(self, index: int, reply: DoneReply) -> DoneReply | None:
        """Record choice `index`'s end; the merged reply once every choice has ended."""
        self.done[index] = reply
        if len(self.done) < self.n:
            return None
        replies = [self.done[i] for i in range(self.n)]
        first = replies[0]
        timings = dict(first.timings)
        timings["e2e_ms"] = max(float(r.timings["e2e_ms"]) for r in replies)
        for name, merge in (("queue_ms", min), ("ttft_ms", min), ("tpt_ms", lambda v: sum(v) / len(v))):
            values = [float(r.timings[name]) for r in replies if name in r.timings]
            if values:
                timings[name] = merge(values)
        usage = dict(first.usage)
        usage["completion_tokens"] = sum(r.usage["completion_tokens"] for r in replies)
        return DoneReply(request_id=first.request_id, finish_reason=first.finish_reason, usage=usage, timings=timings,
                         token_ids=list(first.token_ids), text=first.text, prompt_logprobs=first.prompt_logprobs,
                         choices=[ChoiceOutcome(index=i, finish_reason=r.finish_reason, token_ids=list(r.token_ids),
                                                text=r.text) for i, r in enumerate(replies)])
