"""The gateway's limits without a daemon: the nesting scan against a recursive reference, the
decoder's refusals, the body cap's arithmetic, the decoder process and its pipe format, the
settings and their flags, and a served app's answers to oversized, slow, deep and too many
requests (tests/test_gateway_limits.py has them against a real daemon, with a stream timed)."""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.gateway import json_decode
from loraplex.gateway.app import build_app, listen
from loraplex.gateway.body import BODY_SLACK_BYTES, MAX_BODY_BYTES, body_cap, longest_token_bytes
from loraplex.gateway.cli import config_from, configure, limit_flag
from loraplex.gateway.config import GatewayConfig, limit_fields
from loraplex.gateway.decoders import Decoders
from loraplex.gateway.errors import ApiError
from loraplex.gateway.json_decode import MAX_DEPTH, Refusal, decode, nesting_exceeds
from loraplex.gateway.json_worker import answer, pack, unpack
from loraplex.gateway.schema import MAX_PROMPTS_PER_REQUEST, MAX_REQUEST_TOKEN_IDS
from loraplex.gateway.state import STATE

README = Path(__file__).resolve().parents[1] / "README.md"


def depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


# Strings full of what the scan must see past: brackets, quotes and backslashes.
_TRICKY = st.text(alphabet='[]{}"\\ab,:', max_size=6)
_JSON = st.recursive(st.none() | st.integers() | _TRICKY,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
                     max_leaves=40)


@settings(max_examples=400)
@given(value=_JSON, limit=st.integers(0, 12), ascii_only=st.booleans())
def test_the_nesting_scan_agrees_with_the_structure(value, limit, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nesting_exceeds(text, limit) == (depth(value) > limit)


@pytest.mark.parametrize("item_depth, items", [(3, 5000), (20, 2000), (63, 300), (64, 300), (10, 4000)])
def test_the_nesting_scan_on_wide_bodies(item_depth, items):
    """Many deep items: the pair-removal rounds and the run-by-run sum both decide some."""
    item = "[" * item_depth + "1" + "]" * item_depth
    text = ("[" + ",".join([item] * items) + "]").encode()
    assert nesting_exceeds(text, MAX_DEPTH) == (item_depth + 1 > MAX_DEPTH)
    assert nesting_exceeds(text, item_depth + 1) is False and nesting_exceeds(text, item_depth) is True


def test_bodies_the_decoder_refuses_are_400s(monkeypatch):
    for body in (b"[" * 5000, b"[" * 500 + b"]" * 500, b'{"a": ' * 65 + b"1" + b"}" * 65):
        refusal = decode(body, "completions", None)
        assert refusal == Refusal(400, "the request body nests arrays and objects more than 64 levels deep",
                                  "invalid_json", None)
    assert decode(b'{"a": ' * 63 + b"1" + b"}" * 63, "json", None) is not None  # 63 + the outer object: 64
    for body in (b"\xff", b"{", b"", b'{"prompt": "x"} trailing'):
        refusal = decode(body, "completions", None)
        assert refusal.status == 400 and refusal.code == "invalid_json" and "not valid JSON" in refusal.message
    # The scan is what keeps the parser from recursing; without it, its RecursionError is a 400 too.
    monkeypatch.setattr(json_decode, "nesting_exceeds", lambda body, limit: False)
    assert decode(b"[" * 100_000, "json", None) == Refusal(400, "the request body nests too deeply to parse",
                                                          "invalid_json", None)


def test_parsers_bound_what_the_context_cannot_hold():
    refusal = decode(b'{"prompt": [1, 2, 3, 4, 5]}', "completions", 4)
    assert refusal == Refusal(400, "prompt has 5 tokens; the context holds 4", "context_length_exceeded", "prompt")
    assert decode(b'{"prompt": [[1], [1, 2, 3, 4, 5]]}', "completions", 4).code == "context_length_exceeded"
    assert decode(b'{"prompt": [1, 2, 3, 4]}', "completions", 4).prompts == [[1, 2, 3, 4]]
    assert decode(b'{"prompt": [1, 2, 3, 4, 5]}', "completions", None).prompts == [[1, 2, 3, 4, 5]]
    messages = json.dumps({"messages": [{"role": "user", "content": "x"}] * 5}).encode()
    assert decode(messages, "chat", 4).param == "messages" and decode(messages, "tokenize", 4).code == \
        "context_length_exceeded"
    assert len(decode(messages, "chat", 5).messages) == 5
    budget = MAX_REQUEST_TOKEN_IDS // 4 + 1  # four prompts of this many ids: one id too many in all
    many = json.dumps({"prompt": [[7] * budget] * 4}).encode()
    assert decode(many, "completions", None) == Refusal(
        400, f"the prompts hold {4 * budget} token ids; at most {MAX_REQUEST_TOKEN_IDS} per request", "too_large",
        "prompt")
    assert decode(json.dumps({"tokens": [1] * (MAX_REQUEST_TOKEN_IDS + 1)}).encode(), "detokenize", None).code == \
        "too_large"
    assert decode(json.dumps({"prompt": ["a"] * 129}).encode(), "completions", None).message == \
        "at most 128 prompts per request"
    stops = json.dumps({"prompt": "x", "stop_token_ids": list(range(300))}).encode()
    assert decode(stops, "completions", None).param == "stop_token_ids"
    with pytest.raises(KeyError):
        decode(b"{}", "no-such-endpoint", None)


def test_the_body_cap_is_sized_from_the_context():
    assert body_cap(4096) == MAX_PROMPTS_PER_REQUEST * 4096 * 8 + BODY_SLACK_BYTES == 5 << 20
    assert body_cap(4096, token_bytes=300) == 5 << 20  # token ids need more than any such text prompt
    assert body_cap(4096, token_bytes=1000) == 4096 * 1000 * 3 + BODY_SLACK_BYTES
    assert body_cap(1 << 17) == MAX_BODY_BYTES  # a long context: at most the old fixed cap
    assert body_cap(1) == BODY_SLACK_BYTES + MAX_PROMPTS_PER_REQUEST * 8


def test_the_longest_token_comes_from_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({"a": 0, "hello": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert longest_token_bytes(tmp_path) == 5
    assert longest_token_bytes(None) is None and longest_token_bytes(tmp_path / "nothing") is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{")
    assert longest_token_bytes(tmp_path / "broken") is None


def test_the_worker_pipe_format():
    value = {"big": 10**30, "lone": "\ud800", "f": 1.5, "list": [None, True, -(2**63)]}
    assert unpack(pack(value)) == value
    assert unpack(answer(b'{"prompt": [1, 2]}', "completions", 8)) == [0, {"prompt": [1, 2]}]
    assert unpack(answer(b"[" * 5000, "completions", 8))[:2] == [1, 400]
    assert unpack(answer(b'{"prompt": [1, 2, 3]}', "completions", 2)) == \
        [1, 400, "prompt has 3 tokens; the context holds 2", "context_length_exceeded", "prompt"]


def test_decoder_processes_answer_and_are_replaced_when_they_die():
    async def main() -> None:
        decoders = Decoders(workers=1)
        try:
            body = json.dumps({"prompt": list(range(50_000))}).encode()
            assert await decoders.decode("completions", None, body) == {"prompt": list(range(50_000))}
            assert (await decoders.decode("completions", 10, body)).code == "context_length_exceeded"
            first = decoders._idle[0]
            first.proc.kill()
            await first.proc.wait()
            with pytest.raises(ApiError) as info:
                await decoders.decode("json", None, b"[1]")
            assert info.value.status == 503 and info.value.code == "unavailable"
            assert await decoders.decode("json", None, b"[1]") == [1]  # a new one
            assert decoders._idle[0] is not first
            # A waiter that goes away leaves the exchange to finish: the worker stays usable.
            waiting = asyncio.ensure_future(decoders.decode("json", None, b"[" + b"1," * 2_000_000 + b"1]"))
            await asyncio.sleep(0.05)
            waiting.cancel()
            assert await decoders.decode("json", None, b"[2]") == [2]
        finally:
            await decoders.close()
        assert all(w.proc.returncode is not None for w in (first, *decoders._all))

    asyncio.run(main())


def test_settings_are_checked_and_each_limit_is_a_flag():
    for bad in ({"max_body_bytes": 10}, {"max_body_bytes": True}, {"header_timeout_s": 0},
                {"body_timeout_s": float("nan")}, {"keepalive_timeout_s": -1}, {"max_connections": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GatewayConfig(**bad)
    parser = argparse.ArgumentParser()
    configure(parser)
    names = {f.name for f in limit_fields()}
    assert names == {"max_body_bytes", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s",
                     "max_connections"}
    assert config_from(parser.parse_args([])) == GatewayConfig()
    config = config_from(parser.parse_args(["--max-body-bytes", "2000000", "--header-timeout", "2.5",
                                            "--body-timeout", "30", "--keepalive-timeout", "5",
                                            "--max-connections", "7"]))
    assert (config.max_body_bytes, config.header_timeout_s, config.body_timeout_s, config.keepalive_timeout_s,
            config.max_connections) == (2_000_000, 2.5, 30.0, 5.0, 7)
    with pytest.raises(ValueError):
        config_from(parser.parse_args(["--max-connections", "0"]))


def test_the_readme_documents_every_limit():
    readme = README.read_text()
    section = readme[readme.index("#### Gateway limits"):]
    for f in limit_fields():
        row = next((line for line in section.splitlines() if line.startswith(f"| `{limit_flag(f.name)}` (`{f.name}`)")),
                   None)
        assert row is not None, f"README's gateway limits table has no {limit_flag(f.name)}"
        if f.default is not None:
            assert re.search(rf"\b{f.default:g}\b", row), (row, f.default)


# ---- a served app without a daemon --------------------------------------------------------------
class Served:
    """build_app + listen on a free port, in this test's event loop."""

    def __init__(self, tmp_path: Path, **limits: object) -> None:
        runtime_dir = tmp_path / "rt"
        runtime_dir.mkdir(mode=0o700, exist_ok=True)
        self.config = GatewayConfig(port=0, runtime_dir=runtime_dir, **limits)

    async def __aenter__(self) -> Served:
        self.app = build_app(self.config)
        self.runner, _, self.port = await listen(self.app, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    @property
    def guard(self):
        return self.app[STATE].connections

    async def exchange(self, raw: bytes, timeout: float = 10) -> bytes:
        """Send raw bytes; everything the server answers until it closes (or `timeout`)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(raw)
        reply, deadline = b"", time.monotonic() + timeout
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), max(0.0, deadline - time.monotonic())):
                reply += chunk
                if _complete(reply):
                    break
        except (asyncio.TimeoutError, ConnectionResetError):
            pass
        writer.close()
        return reply


def _complete(reply: bytes) -> bool:
    head, found, body = reply.partition(b"\r\n\r\n")
    length = re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)
    return bool(found) and length is not None and len(body) >= int(length[1])


async def _closed(reader: asyncio.StreamReader, timeout: float = 2) -> bool:
    """Whether the server closes the connection within `timeout` (its end, or a reset)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout) == b""
    except ConnectionError:
        return True


def _post(body: bytes, length: int | None = None) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length)) + body


def _error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_served_app_refuses_big_deep_and_slow_bodies(tmp_path):
    async def main() -> None:
        async with Served(tmp_path, max_body_bytes=200_000, body_timeout_s=0.5) as gw:
            status, error = _error(await gw.exchange(_post(b"", length=10_000_000)))
            assert (status, error["code"], error["type"]) == (413, "request_too_large", "invalid_request_error")
            assert "200000 bytes (max_body_bytes)" in error["message"]
            chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
                       b"%x\r\n%s\r\n" % (300_000, b" " * 300_000) + b"0\r\n\r\n")
            assert _error(await gw.exchange(chunked))[0] == 413
            for body in (b"[" * 5000, b'{"prompt": ' + b"[" * 90_000 + b"]" * 90_000 + b"}"):  # inline, worker
                status, error = _error(await gw.exchange(_post(body)))
                assert (status, error["code"]) == (400, "invalid_json"), error
            started = time.monotonic()
            status, error = _error(await gw.exchange(_post(b'{"prompt": ', length=100)))
            assert (status, error["code"]) == (408, "request_timeout") and time.monotonic() - started >= 0.5
            # Under the limits, the body reaches the daemon (here: none, so a 503).
            status, error = _error(await gw.exchange(_post(b'{"prompt": "hi", "max_tokens": 2}')))
            assert (status, error["code"]) == (503, "unavailable")

    asyncio.run(main())


def test_a_served_app_closes_slow_heads_and_caps_connections(tmp_path):
    async def main() -> None:
        async with Served(tmp_path, header_timeout_s=0.4, max_connections=3, keepalive_timeout_s=30) as gw:
            held = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(3)]
            for _, writer in held:
                writer.write(b"GET /version HTTP/1.1\r\nHost:")
            await asyncio.sleep(0.1)
            assert gw.guard.open == 3
            refused = await gw.exchange(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            assert refused == b"" or _error(refused)[1]["code"] == "too_many_connections"
            assert gw.guard.refused.total == 1
            for reader, writer in held:  # dribbling bytes does not extend the deadline
                for _ in range(3):
                    writer.write(b"x")
                    await asyncio.sleep(0.05)
            started = time.monotonic()
            for reader, _ in held:
                assert await _closed(reader)
            assert time.monotonic() - started < 1.0 and gw.guard.timed_out.total == 3
            await asyncio.sleep(0.05)
            assert gw.guard.open == 0
            for _, writer in held:
                writer.close()
            # A keep-alive connection: the next head's deadline starts with its first byte.
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            for _ in range(2):
                writer.write(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
                assert head.startswith(b"HTTP/1.1 200")
                length = int(re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)[1])
                await reader.readexactly(length)
                await asyncio.sleep(0.6)  # idle longer than header_timeout_s: still open
            writer.write(b"GET /version HTTP/1.1\r\n")
            assert await _closed(reader)  # a slow head after idling: closed
            writer.close()

    asyncio.run(main())


def test_the_guard_passes_streams_and_keeps_aiohttps_bookkeeping(tmp_path):
    """Many ordinary requests at once through the guarded protocol: all answered, none leaked."""
    async def main() -> None:
        async with Served(tmp_path, max_connections=64) as gw:
            replies = await asyncio.gather(*(gw.exchange(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close"
                                                         b"\r\n\r\n") for _ in range(50)))
            assert all(r.startswith(b"HTTP/1.1 200") for r in replies)
            await asyncio.sleep(0.1)
            assert gw.guard.open == 0 and not gw.guard.handlers and gw.guard.refused.total == 0
            assert len(gw.runner.server.connections) == 0

    asyncio.run(main())


def test_connections_over_the_cap_are_refused_with_one_log_line_per_burst(tmp_path, caplog):
    async def main() -> None:
        async with Served(tmp_path, max_connections=1, header_timeout_s=5) as gw:
            first = await asyncio.open_connection("127.0.0.1", gw.port)
            for _ in range(20):
                await gw.exchange(b"", timeout=1)
            first[1].close()
            assert gw.guard.refused.total == 20

    with caplog.at_level("WARNING", logger="loraplex.gateway"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "refused past max_connections = 1" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("refused past max_connections = 1: 1 connection(s)")


def test_socket_level_refusal_answers_503(tmp_path):
    """The refusal is a whole HTTP response when the client reads before it writes."""
    async def main() -> None:
        async with Served(tmp_path, max_connections=1, header_timeout_s=5) as gw:
            first = await asyncio.open_connection("127.0.0.1", gw.port)
            loop = asyncio.get_running_loop()
            sock = socket.create_connection(("127.0.0.1", gw.port))
            sock.setblocking(False)
            reply = b""
            while not reply.endswith(b"}"):
                reply += await asyncio.wait_for(loop.sock_recv(sock, 4096), 2)
            sock.close()
            first[1].close()
            status, error = _error(reply)
            assert status == 503 and error["code"] == "too_many_connections" and error["type"] == "server_error"

    asyncio.run(main())


def test_the_nesting_scan_is_linear_on_an_unterminated_string_of_escaped_quotes() -> None:
    """A body under the inline size of `[`s then `"\\"\\"\\"...` with no closing quote: a string pattern that
    must end on a quote retried from every quote (quadratic: 40 KB took 8 s on the loop)."""
    body = b"[" * (MAX_DEPTH + 1) + b' "' + b'\\"' * 30_000
    started = time.perf_counter()
    nesting_exceeds(body, MAX_DEPTH)
    assert time.perf_counter() - started < 0.5
