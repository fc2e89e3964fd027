"""The body decoder process (`python -m loraplex.gateway.json_worker`) and its pipe format; the
gateway starts it (gateway/decoders.py) and sends it each large body, so that json.loads, which
holds the GIL for its whole run, never runs in the gateway's process.

Frames on stdin and stdout: an 8-byte big-endian length, then that many bytes. A request is two
frames: msgpack [endpoint, context], then the raw body. The reply is one msgpack frame:
[0, json] (the body's JSON, which PARSERS[endpoint] accepted) or [1, status, message, code,
param] (a Refusal). One request at a time; exits at end of input. Never imports torch.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, BinaryIO

import msgpack

from loraplex.gateway.json_decode import Refusal, load, parse

log = logging.getLogger("loraplex.gateway")
HEADER_BYTES = 8
NICENESS = 10
_BIG_INT = 1  # msgpack ext type of an integer past 64 bits (JSON allows any)


def length_prefix(payload: bytes | bytearray) -> bytes:
    return len(payload).to_bytes(HEADER_BYTES, "big")


def pack(value: Any) -> bytes:
    """msgpack of decoded JSON: big integers as ext, lone surrogates kept as JSON keeps them."""
    return msgpack.packb(value, default=_big_int, unicode_errors="surrogatepass")


def unpack(data: bytes | bytearray) -> Any:
    return msgpack.unpackb(data, ext_hook=_int_from_ext, unicode_errors="surrogatepass")


def _big_int(value: object) -> msgpack.ExtType:
    if isinstance(value, int):
        return msgpack.ExtType(_BIG_INT, str(value).encode())
    raise TypeError(f"cannot pack {type(value).__name__}")


def _int_from_ext(code: int, data: bytes) -> int:
    if code != _BIG_INT:
        raise ValueError(f"unknown msgpack ext type {code}")
    return int(data)


def _read(stream: BinaryIO, size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def answer(body: bytes, endpoint: str, context: int | None) -> bytes:
    """The reply payload for one body."""
    try:
        value = load(body)
        result = value if isinstance(value, Refusal) else parse(value, endpoint, context)
        if isinstance(result, Refusal):
            return pack([1, *result])
        return pack([0, value])
    except MemoryError:
        return pack([1, 413, "the request body is too large to decode", "request_too_large", None])
    except Exception:  # a bug in a parser: answered as the gateway answers its own bugs
        log.exception("decoding a %d-byte body for %s failed", len(body), endpoint)
        return pack([1, 500, "internal error in the gateway; see its log", "internal", None])


def main() -> int:
    logging.basicConfig(level="WARNING", format="loraplex-gateway decoder %(levelname)s %(message)s")
    try:  # parsing is background work: the engine and the gateway's loop come first on a busy host
        os.nice(NICENESS)
    except OSError:
        pass
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while (head := _read(inp, HEADER_BYTES)) is not None:
        request = _read(inp, int.from_bytes(head, "big"))
        size = _read(inp, HEADER_BYTES)
        body = _read(inp, int.from_bytes(size, "big")) if size is not None else None
        if request is None or body is None:
            return 1
        endpoint, context = unpack(request)
        reply = answer(body, endpoint, context)
        out.write(length_prefix(reply))
        out.write(reply)
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
