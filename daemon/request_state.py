"""One client request as the daemon tracks it: who asked, what was asked,
what has been streamed, and the timings the final `done` reports.

Turns sampled token ids into client replies: incremental UTF-8-safe text,
stop strings matched across chunk boundaries, usage and timings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplex.daemon.detokenizer import IncrementalDetokenizer, StopStringMatcher
from loraplex.daemon.prompt_logprobs import PromptLogprobBook
from loraplex.ipc.engine_plan import RowResult
from loraplex.ipc.protocol import (
    MAX_TOKEN_TEXT_LEN,
    DoneReply,
    GenerateRequest,
    PromptLogprobs,
    TokenChunk,
    TopLogprobs,
)


@dataclass(slots=True)
class ClientRequest:
    key: str  # scheduler-wide id: client identity + the client's request id
    identity: bytes
    msg: GenerateRequest
    prompt_ids: list[int]
    detok: IncrementalDetokenizer | None
    stops: StopStringMatcher | None
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    adapter_path: str = "base"
    first_scheduled: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held when it first ran
    first_token_at: float | None = None
    last_token_at: float | None = None
    first_step_engine_ms: float | None = None  # engine compute of the step that produced the first token
    engine_retries: int = 0  # times this request was recomputed after its engine died
    engine: int = 0  # index of the engine replica serving it
    migrations: int = 0  # times it moved to another engine (co-migration)
    choice: int = 0  # which of its request's n completions
    prompt_book: PromptLogprobBook | None = None  # its prompt logprobs, when asked (choice 0 only)

    @property
    def request_id(self) -> str:
        return self.msg.request_id

    def on_token(self, row: RowResult) -> tuple[TokenChunk | None, bool]:
        """Record one sampled token; return the chunk to stream (if any) and whether a stop string hit."""
        token_id, logprob = row.token_id, row.logprob
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        index = len(self.token_ids)
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        piece = self.detok.push([token_id]) if self.detok is not None else ""
        stopped = False
        if self.stops is not None:
            piece, stopped = self.stops.feed(piece)
        self.text += piece
        if not self.msg.stream:
            return None, stopped
        wants_logprobs = (self.msg.logprobs or self.msg.top_logprobs > 0) and logprob is not None
        top = [self._alternatives(row)] if self.msg.top_logprobs > 0 else None
        chunk = TokenChunk(request_id=self.request_id, token_ids=[token_id], text=piece,
                           logprobs=[logprob] if wants_logprobs else None, index=index, top_logprobs=top,
                           choice=self.choice)
        return chunk, stopped

    def _alternatives(self, row: RowResult) -> TopLogprobs:
        """The engine's top alternatives, each decoded alone (as vLLM spells them)."""
        tokenizer = self.detok.tokenizer if self.detok is not None else None
        texts = [tokenizer.decode([t], skip_special_tokens=False)[:MAX_TOKEN_TEXT_LEN] if tokenizer is not None else ""
                 for t in row.top_ids]
        return TopLogprobs(token_ids=list(row.top_ids), logprobs=list(row.top_logprobs), texts=texts)

    def finish_text(self, stopped: bool) -> str:
        """Text still held back (an incomplete UTF-8 tail or a possible stop-string prefix)."""
        if stopped:
            return ""
        tail = self.detok.flush() if self.detok is not None else ""
        if self.stops is not None:
            tail, _ = self.stops.feed(tail)
            tail += self.stops.flush()
        self.text += tail
        return tail

    def scored_prompt(self) -> PromptLogprobs | None:
        """The prompt logprobs the done reply carries (None when not asked). Detokenizes up to every
        prompt token and alternative: call it off the event loop (RequestTable.finish does)."""
        if self.prompt_book is None:
            return None
        return self.prompt_book.reply(self.prompt_ids, self.detok.tokenizer if self.detok else None)

    def done(self, finish_reason: str, prompt_logprobs: PromptLogprobs | None = None) -> DoneReply:
        now = time.monotonic()
        timings: dict[str, float | str] = {
            "queue_ms": _ms((self.first_scheduled or now) - self.arrival),
            "e2e_ms": _ms(now - self.arrival),
            "adapter_path": self.adapter_path,
        }
        if self.first_token_at is not None and self.last_token_at is not None:
            timings["ttft_ms"] = _ms(self.first_token_at - self.arrival)
            n = len(self.token_ids)
            timings["tpt_ms"] = _ms((self.last_token_at - self.first_token_at) / (n - 1)) if n > 1 else 0.0
        if self.first_step_engine_ms is not None:
            timings["first_step_engine_ms"] = self.first_step_engine_ms
        return DoneReply(
            request_id=self.request_id, finish_reason=finish_reason,
            usage={"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.token_ids),
                   "cached_tokens": self.cached_tokens},
            timings=timings, token_ids=list(self.token_ids), text=self.text,
            prompt_logprobs=prompt_logprobs,
        )


def _ms(seconds: float) -> float:
    return max(0.0, seconds * 1e3)
