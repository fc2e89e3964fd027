"""Request bodies for every handler: read within the byte cap (max_body_bytes, by default sized
from the daemon's context) and the body deadline (body_timeout_s), then decoded: on the event
loop when small, first in a decoder process when large (gateway/decoders.py).

The event loop never parses a large body: json.loads holds the GIL for its whole run, so a
worker thread would stall every stream as surely as the loop itself. Opens no sockets of its
own; asks the daemon for its context through the shared client.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from loraplex.gateway.config import GatewayConfig
from loraplex.gateway.decoders import Decoders
from loraplex.gateway.errors import ApiError
from loraplex.gateway.json_decode import PARSERS, Refusal, decode, parse
from loraplex.gateway.schema import MAX_PROMPTS_PER_REQUEST
from loraplex.ipc.errors import LoraplexError, ProtocolError

log = logging.getLogger("loraplex.gateway")

# The derived cap: MAX_PROMPTS_PER_REQUEST prompts of token ids each filling the context, at
# TOKEN_ID_JSON_BYTES per id, plus BODY_SLACK_BYTES for every other field. That is also 1 KiB
# per token for one text prompt; a vocabulary entry longer than 341 UTF-8 bytes (known from
# --model-dir's tokenizer.json) raises it to JSON_BYTES_PER_TEXT_BYTE times that per token.
TOKEN_ID_JSON_BYTES = 8  # an id of up to 6 digits and the ", " after it
JSON_BYTES_PER_TEXT_BYTE = 3  # \uXXXX spells a 2- or 3-byte UTF-8 character in 6 bytes, a 4-byte one in 12
BODY_SLACK_BYTES = 1 << 20  # sampling fields, a guided_json schema, logit_bias, chat roles
MAX_BODY_BYTES = 64 << 20  # the most a derived cap allows, and the cap while the context is unknown
INLINE_BODY_BYTES = 64 << 10  # bodies up to this are decoded on the event loop (about a millisecond)
CONTEXT_TTL_S = 60.0  # how long the daemon's max_model_len is trusted before it is asked again
CONTEXT_RETRY_S = 5.0  # after a failed ask
CONTEXT_TIMEOUT_S = 2.0


def body_cap(max_model_len: int, token_bytes: int | None = None) -> int:
    """The default max_body_bytes for a daemon serving `max_model_len` tokens; `token_bytes`:
    the tokenizer's longest vocabulary entry in UTF-8 bytes, if known."""
    ids = MAX_PROMPTS_PER_REQUEST * max_model_len * TOKEN_ID_JSON_BYTES
    text = max_model_len * token_bytes * JSON_BYTES_PER_TEXT_BYTE if token_bytes else 0
    return min(MAX_BODY_BYTES, max(ids, text) + BODY_SLACK_BYTES)


def longest_token_bytes(model_dir: Path | None) -> int | None:
    """The longest vocabulary entry of the model directory's tokenizer.json, in UTF-8 bytes (the
    daemon's bound on the text one token covers); None without one."""
    path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer  # a light dependency; only with --model-dir

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as exc:  # the daemon reports a broken tokenizer; here it only loses the text bound
        log.warning("could not read %s (%s); the body cap counts token ids only", path, exc)
        return None
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


class Bodies:
    """The byte cap, the body deadline, the daemon's context as last learned, and the decoder
    processes for large bodies."""

    def __init__(self, config: GatewayConfig, client: Any, token_bytes: int | None = None) -> None:
        self._explicit = config.max_body_bytes
        self._timeout_s = config.body_timeout_s
        self._tokenize = getattr(client, "tokenize", None)  # the Ray cluster's client has none
        self._token_bytes = token_bytes
        self.max_model_len: int | None = None
        self._next_ask = 0.0
        self._ask_lock = asyncio.Lock()
        self._decoders = Decoders()

    @property
    def cap(self) -> int:
        if self._explicit is not None:
            return self._explicit
        if self.max_model_len is None:
            return MAX_BODY_BYTES
        return body_cap(self.max_model_len, self._token_bytes)

    async def json(self, request: web.Request, endpoint: str = "json") -> Any:
        """The request's body as PARSERS[endpoint] makes it (given the context as last learned),
        or the ApiError refusing it."""
        if endpoint not in PARSERS:
            raise ValueError(f"no body parser {endpoint!r}")
        body = await self.read(request)
        context = self.max_model_len
        if len(body) <= INLINE_BODY_BYTES:
            result = decode(body, endpoint, context)
        else:  # checked in a decoder process; here only unpacked, and parsed again into its types
            value = await self._decoders.decode(endpoint, context, body)
            result = value if isinstance(value, Refusal) else parse(value, endpoint, context)
        if isinstance(result, Refusal):
            raise result.error()
        return result

    async def read(self, request: web.Request) -> bytearray:
        """The whole body: 413 past the cap (at once when Content-Length says so), 408 when it
        has not all arrived body_timeout_s after the handler started."""
        try:
            return await asyncio.wait_for(self._read(request), self._timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within body_timeout_s = {self._timeout_s:g} s",
                           code="request_timeout") from None

    async def _read(self, request: web.Request) -> bytearray:
        declared = request.content_length
        if declared is not None:
            await self._check(declared)
        body = bytearray()
        while chunk := await request.content.readany():
            body += chunk
            await self._check(len(body))
        return body

    async def _check(self, size: int) -> None:
        if self._explicit is None or size <= self._explicit:
            if size > BODY_SLACK_BYTES:  # any derived cap holds this much: only larger bodies need the context
                await self._learn()
        if size > self.cap:
            origin = "max_body_bytes" if self._explicit is not None else "max_body_bytes, sized from the context"
            raise ApiError(413, f"the request body is larger than the gateway's limit of {self.cap} bytes ({origin})",
                           code="request_too_large")

    async def _learn(self) -> None:
        """Ask the daemon for its max_model_len (an empty tokenize) unless asked recently."""
        if self._tokenize is None or time.monotonic() < self._next_ask:
            return
        async with self._ask_lock:
            if time.monotonic() < self._next_ask:
                return
            try:
                self.max_model_len = (await self._tokenize("", timeout=CONTEXT_TIMEOUT_S)).max_model_len or None
                self._next_ask = time.monotonic() + CONTEXT_TTL_S
            except (LoraplexError, ProtocolError):  # no daemon yet, or a model without tokenizer.json
                self._next_ask = time.monotonic() + CONTEXT_RETRY_S

    async def close(self) -> None:
        await self._decoders.close()
