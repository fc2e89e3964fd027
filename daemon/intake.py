"""Prompts on their way in: bounded before any work, tokenized off the event loop.

Owns the checks a prompt passes before it reaches a scheduler (context length, vocabulary,
`max_tokens` against what the context leaves), the cheap size bound that refuses a text
prompt too long for the context before it is tokenized, the tokenizer's worker threads
(server.tokenizer_threads) served round-robin by client, and each client's budget of prompt
bytes waiting for them (server.max_queued_prompt_bytes_per_client). Never tokenizes on the
event loop: one client's huge or numerous prompts must not delay another client's tokens,
nor hold its prompts behind all of theirs.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from loraplex.daemon.rejected import Rejected
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")

# Normalizers (NFC and the like) may shrink text before it is split: composing three code points
# into one is the most Unicode normalization does, so a factor of 4 keeps the bound conservative.
NORMALIZER_SLACK = 4


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the prompt characters one token can cover: the longest vocabulary entry
    in UTF-8 bytes (byte-level and SentencePiece entries spell each byte with one or more bytes)."""
    return max((len(token.encode("utf-8")) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # encode_batch releases the GIL while it works; encode was measured holding it for up to two
    # seconds of a 3 MB prompt, which would stall the event loop even from a worker thread.
    return tokenizer.encode_batch([text])[0].ids


@dataclass(slots=True)
class _Job:
    identity: bytes
    text: str
    size: int
    done: asyncio.Future = field(repr=False)
    started: bool = False


class PromptIntake:
    """The model's limits and tokenizer (None: only token-id prompts are accepted)."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, *, threads: int,
                 max_queued_bytes_per_client: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.threads = threads
        self.max_queued_bytes = max_queued_bytes_per_client
        self.token_chars = longest_token_chars(tokenizer) if tokenizer is not None else 0
        # More characters than this cannot fit in the context whatever the text is.
        self.max_prompt_chars = max_model_len * self.token_chars * NORMALIZER_SLACK
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenizer") \
            if tokenizer is not None else None
        self._queued: dict[bytes, int] = {}  # client identity -> prompt bytes waiting or being tokenized
        self._waiting: OrderedDict[bytes, deque[_Job]] = OrderedDict()  # clients in their turn's order
        self._wake = asyncio.Event()
        self._workers: list[asyncio.Task] = []  # one per thread, started with the first prompt

    def close(self) -> None:
        for task in self._workers:
            task.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def queued_bytes(self, identity: bytes) -> int:
        return self._queued.get(identity, 0)

    def check_text(self, text: str) -> None:
        """Refuse, before any work, a text prompt that cannot be tokenized here or cannot fit."""
        if self.tokenizer is None:
            raise Rejected(ErrorCode.INVALID_FIELD, "this model has no tokenizer.json; send prompt_token_ids")
        if len(text) > self.max_prompt_chars:
            raise Rejected(ErrorCode.PROMPT_TOO_LONG,
                           f"the prompt has {len(text)} characters: more than the context of {self.max_model_len} "
                           f"tokens can hold (no token of this model covers more than {self.token_chars} "
                           "characters); refused before tokenizing")

    async def encode(self, identity: bytes, text: str) -> list[int]:
        """The prompt's token ids, computed in a tokenizer thread when the client's turn comes
        (clients take turns, one prompt each). A client whose earlier prompts still wait gets
        `overloaded` past its byte budget (one prompt alone always goes); its bytes count until
        a thread is done with them, or until a cancelled prompt leaves the queue unstarted."""
        size = len(text.encode("utf-8", "surrogatepass"))
        queued = self._queued.get(identity, 0)
        if queued and queued + size > self.max_queued_bytes:
            raise Rejected(ErrorCode.OVERLOADED,
                           f"this client already has {queued} bytes of prompts waiting to be tokenized "
                           f"(server.max_queued_prompt_bytes_per_client = {self.max_queued_bytes}); try again later")
        if not self._workers:
            self._workers = [asyncio.create_task(self._work(), name=f"tokenizer-{i}") for i in range(self.threads)]
        job = _Job(identity, text, size, asyncio.get_running_loop().create_future())
        self._queued[identity] = queued + size
        self._waiting.setdefault(identity, deque()).append(job)
        self._wake.set()
        try:
            ids = await job.done
        except asyncio.CancelledError:
            if not job.started:  # still queued: it leaves now
                self._waiting.get(identity, deque()).remove(job)
                if not self._waiting.get(identity, True):
                    del self._waiting[identity]
                self._release(identity, size)
            raise
        if not ids:
            raise Rejected(ErrorCode.INVALID_FIELD, "the prompt encodes to no tokens")
        return ids

    def _next(self) -> _Job | None:
        """The head of the first client's queue; that client goes to the back of the line."""
        while self._waiting:
            identity, jobs = next(iter(self._waiting.items()))
            job = jobs.popleft()
            if jobs:
                self._waiting.move_to_end(identity)
            else:
                del self._waiting[identity]
            if not job.done.done():
                return job
            self._release(job.identity, job.size)  # cancelled meanwhile (a race encode() did not see)
        return None

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = self._next()
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            job.started = True
            try:
                ids = await loop.run_in_executor(self._executor, _encode, self.tokenizer, job.text)
            except Exception as exc:  # the request fails with it; the worker goes on
                if not job.done.done():
                    job.done.set_exception(exc)
            else:
                if not job.done.done():
                    job.done.set_result(ids)
            finally:
                self._release(job.identity, job.size)

    def _release(self, identity: bytes, size: int) -> None:
        left = self._queued.get(identity, 0) - size
        if left > 0:
            self._queued[identity] = left
        else:
            self._queued.pop(identity, None)

    async def decode(self, ids: list[int]) -> str:
        """The text of `ids` (special tokens kept), decoded in a tokenizer thread."""
        if self.tokenizer is None:
            raise Rejected(ErrorCode.INVALID_FIELD, "this model has no tokenizer.json; nothing can be decoded")
        self.check_vocab(ids, "token_ids")
        return await asyncio.get_running_loop().run_in_executor(self._executor, _decode, self.tokenizer, ids)

    def check_vocab(self, ids: list[int], what: str) -> None:
        """Refuse token ids outside the model's vocabulary (logit_bias keys, stop_token_ids)."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise Rejected(ErrorCode.INVALID_TOKEN,
                           f"{what}: token id {bad} is outside the vocabulary (size {self.vocab_size})")

    def check_ids(self, ids: list[int], max_tokens: int | None) -> int:
        """Check a prompt's ids against the model; return how many tokens it may generate:
        `max_tokens`, or all the context leaves when None (vLLM's default). Refused when the
        prompt plus `max_tokens` exceed the context, as vLLM does, rather than silently cut."""
        limit = self.max_model_len
        if len(ids) >= limit:  # before the scan below: O(1) first
            raise Rejected(ErrorCode.PROMPT_TOO_LONG,
                           f"prompt has {len(ids)} tokens; the context holds {limit} (prompt + at least 1 new token)")
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise Rejected(ErrorCode.INVALID_TOKEN,
                           f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        room = limit - len(ids)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise Rejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                           f"max_tokens is {max_tokens} but the prompt has {len(ids)} tokens and the context holds "
                           f"{limit}: at most {room} new tokens fit; lower max_tokens or leave it unset")
        return max_tokens

