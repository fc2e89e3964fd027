"""The client library (sync and asyncio) against a fake daemon: a ROUTER in a
thread, scripted by the prompt, on ipc:// endpoints in tmp_path."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator

import pytest
import uvloop
import zmq

from loraplex.ipc.client import (
    AdapterInfo,
    AdminClient,
    AsyncAdminClient,
    AsyncClient,
    Client,
    ErrorCode,
    GenerateResult,
    Liveness,
    LoraplexError,
    new_request_id,
)
from loraplex.ipc.protocol import (
    AdaptersReply,
    AddAdapterRequest,
    AdminOkReply,
    CancelRequest,
    DoneReply,
    DrainRequest,
    ErrorReply,
    GenerateRequest,
    ListAdaptersRequest,
    Message,
    PinAdapterRequest,
    PingRequest,
    PongReply,
    RemoveAdapterRequest,
    SetPolicyRequest,
    StatsReply,
    StatsRequest,
    TokenChunk,
)
from loraplex.ipc.runtime_dir import endpoints, ipc_endpoint
from loraplex.ipc.sockets import PeerUnavailable, make_router

WAIT_S = 5.0
# Fast liveness for the tests that exercise it; a generous one elsewhere.
FAST = Liveness(probe_after_s=0.2, probe_timeout_s=0.3)

ADAPTER_ENTRY = {"name": "qv-r8", "path": "/models/qv-r8", "rank": 8, "target_modules": ["q_proj", "v_proj"],
                 "state": "host", "pinned": False}


def completion(req: GenerateRequest) -> tuple[list[int], list[str]]:
    """What the fake 'model' answers: the prompt upper-cased (text) or reversed (ids)."""
    if req.prompt is not None:
        pieces = list(req.prompt.upper())
        ids = [ord(c) for c in pieces]
    else:
        ids = list(reversed(req.prompt_token_ids or []))
        pieces = [f"<{t}>" for t in ids]
    return ids[: req.max_tokens], pieces[: req.max_tokens]


def replies_for(req: GenerateRequest, finish: str | None = None) -> list[Message]:
    """Token chunks of two tokens each (when streaming), then done."""
    ids, pieces = completion(req) if finish is None else ([], [])
    out: list[Message] = []
    if req.stream:
        for i in range(0, len(ids), 2):
            lp = [-0.5 * (i + k) for k in range(len(ids[i:i + 2]))] if req.logprobs else None
            out.append(TokenChunk(request_id=req.request_id, token_ids=ids[i:i + 2], text="".join(pieces[i:i + 2]),
                                  logprobs=lp, index=i))
    full = len(ids) == req.max_tokens and finish is None
    timings: dict[str, float | str] = {"queue_ms": 1.0, "e2e_ms": 5.0}
    timings["adapter_path"] = "cached" if req.adapter else "base"
    if ids:
        timings.update(ttft_ms=2.0, tpt_ms=0.5)
    out.append(DoneReply(
        request_id=req.request_id, finish_reason=finish or ("length" if full else "stop"),
        usage={"prompt_tokens": len(req.prompt or req.prompt_token_ids or []), "completion_tokens": len(ids)},
        timings=timings, token_ids=ids, text="".join(pieces),
    ))
    return out


class FakeDaemon:
    """Client (and admin) ROUTERs served by one thread. Prompts script it:
    "hang" gets no answer until cancelled; "drip" streams one chunk then
    hangs; "fail:<code>" is refused with that code; "batch:<n>:<i>" is held
    until n arrived, then all n are answered with their replies interleaved
    in random order; anything else is answered at once. `mute` makes it
    answer nothing at all (a hung daemon)."""

    def __init__(self, client_ep: str, admin_ep: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sockets = {"client": make_router(self.ctx, client_ep)}
        if admin_ep is not None:
            self.sockets["admin"] = make_router(self.ctx, admin_ep)
        self.received: list[tuple[str, bytes, Message]] = []
        self.mute = False
        self._cond = threading.Condition()
        self._held: dict[str, tuple[bytes, GenerateRequest]] = {}
        self._batch: list[tuple[bytes, GenerateRequest]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        by_zmq = {}
        for name, sock in self.sockets.items():
            poller.register(sock.socket, zmq.POLLIN)
            by_zmq[sock.socket] = (name, sock)
        while not self._stop.is_set():
            for zsock in dict(poller.poll(20)):
                name, sock = by_zmq[zsock]
                identity, msg = sock.recv(0)
                with self._cond:
                    self.received.append((name, identity, msg))
                    self._cond.notify_all()
                if not self.mute:
                    self._serve(sock, identity, msg)
        for sock in self.sockets.values():
            sock.close()

    def _send(self, sock: Any, identity: bytes, msg: Message) -> None:
        try:
            sock.send(msg, identity)
        except PeerUnavailable:
            pass

    def _serve(self, sock: Any, identity: bytes, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        if isinstance(msg, GenerateRequest):
            prompt = msg.prompt or ""
            if prompt.startswith("fail:"):
                self._send(sock, identity, ErrorReply(request_id=rid, code=prompt[5:], message="refused by the fake"))
            elif prompt in ("hang", "drip"):
                self._held[msg.request_id] = (identity, msg)
                if prompt == "drip":
                    self._send(sock, identity, replies_for(msg)[0])
            elif prompt.startswith("batch:"):
                self._batch.append((identity, msg))
                if len(self._batch) == int(prompt.split(":")[1]):
                    self._flush_batch(sock)
            else:
                for reply in replies_for(msg):
                    self._send(sock, identity, reply)
        elif isinstance(msg, CancelRequest):
            held = self._held.pop(msg.request_id, None)
            if held is None:
                self._send(sock, identity, ErrorReply(request_id=rid, code="not_found", message="no such request"))
            else:
                self._send(sock, identity, replies_for(held[1], finish="cancelled")[-1])
        elif isinstance(msg, PingRequest):
            self._send(sock, identity, PongReply(request_id=rid))
        elif isinstance(msg, StatsRequest):
            self._send(sock, identity, StatsReply(stats={"running": len(self._held), "socket": "x"}, request_id=rid))
        elif isinstance(msg, ListAdaptersRequest):
            self._send(sock, identity, AdaptersReply(adapters=[ADAPTER_ENTRY], request_id=rid))
        elif isinstance(msg, AddAdapterRequest) and msg.name == "dup":
            self._send(sock, identity, ErrorReply(request_id=rid, code="already_exists", message="dup exists"))
        else:
            self._send(sock, identity, AdminOkReply(detail={"op": msg.TYPE}, request_id=rid))

    def _flush_batch(self, sock: Any) -> None:
        queues = [(identity, replies_for(req)) for identity, req in self._batch]
        self._batch.clear()
        rng = random.Random(7)
        while queues:
            k = rng.randrange(len(queues))
            identity, pending = queues[k]
            self._send(sock, identity, pending.pop(0))
            if not pending:
                queues.pop(k)

    def wait_for(self, pred: Callable[[Message], bool], timeout: float = WAIT_S, socket: str = "client") -> Message:
        """The first received message matching `pred` (waiting up to `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for name, _, msg in self.received:
                    if name == socket and pred(msg):
                        return msg
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the fake daemon never received the expected message; got {self.received}")
                self._cond.wait(left)

    def messages(self, cls: type[Message], socket: str = "client") -> list[Any]:
        with self._cond:
            return [m for name, _, m in self.received if name == socket and isinstance(m, cls)]

    def identities(self) -> set[bytes]:
        with self._cond:
            return {identity for name, identity, _ in self.received if name == "client"}

    def stop(self) -> None:
        """Close the sockets, like a daemon that died."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(timeout=WAIT_S)
            self.ctx.destroy(linger=0)


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def fake(runtime_dir: Path) -> Iterator[FakeDaemon]:
    eps = endpoints(runtime_dir)
    daemon = FakeDaemon(eps.client, eps.admin)
    yield daemon
    daemon.stop()


@pytest.fixture
def client(fake: FakeDaemon, runtime_dir: Path) -> Iterator[Client]:
    with Client(runtime_dir=runtime_dir) as c:
        yield c


def run_async(coro_fn: Callable[[], Coroutine[Any, Any, Any]], use_uvloop: bool = False) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro_fn(), timeout=15)

    loop = uvloop.new_event_loop() if use_uvloop else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(bounded())
    finally:
        loop.close()


def is_generate(prompt: str) -> Callable[[Message], bool]:
    return lambda m: isinstance(m, GenerateRequest) and m.prompt == prompt


# -- sync client ---------------------------------------------------------------

def test_generate_returns_the_done_reply(client: Client, fake: FakeDaemon) -> None:
    result = client.generate("hello", adapter="qv-r8", max_tokens=3, temperature=0.0, top_k=5, seed=3,
                             stop="\n", stop_token_ids=[2], priority=-1, slo_ttft_ms=50.0, timeout=30)
    assert isinstance(result, GenerateResult)
    assert (result.text, result.token_ids, result.finish_reason) == ("HEL", [72, 69, 76], "length")
    assert result.usage == {"prompt_tokens": 5, "completion_tokens": 3}
    assert {"queue_ms", "ttft_ms", "tpt_ms", "e2e_ms"} <= result.timings.keys()
    assert result.timings["adapter_path"] == "cached" and result.logprobs is None
    sent = fake.messages(GenerateRequest)[0]
    assert sent.request_id == result.request_id and result.request_id.startswith("lpx-")
    assert (sent.adapter, sent.max_tokens, sent.temperature, sent.top_k, sent.seed) == ("qv-r8", 3, 0.0, 5, 3)
    assert (sent.stop, sent.stop_token_ids, sent.priority, sent.slo_ttft_ms) == (["\n"], [2], -1, 50.0)
    assert sent.deadline_ms == 30_000.0 and not sent.stream


def test_token_id_prompt_and_base_model(client: Client, fake: FakeDaemon) -> None:
    result = client.generate([5, 6, 7], max_tokens=10)
    assert (result.token_ids, result.text, result.finish_reason) == ([7, 6, 5], "<7><6><5>", "stop")
    assert result.timings["adapter_path"] == "base"
    sent = fake.messages(GenerateRequest)[0]
    assert sent.prompt is None and sent.prompt_token_ids == [5, 6, 7] and sent.adapter is None


def test_stream_yields_chunks_in_order_and_then_the_result(client: Client) -> None:
    stream = client.stream("streaming!", max_tokens=7, logprobs=True)
    assert stream.result is None
    chunks = list(stream)
    assert [c.index for c in chunks] == [0, 2, 4, 6]
    assert all(c.request_id == stream.request_id for c in chunks)
    result = stream.result
    assert result is not None and "".join(c.text for c in chunks) == result.text == "STREAMI"
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    assert result.logprobs == [lp for c in chunks for lp in (c.logprobs or [])] == [-0.5 * i for i in range(7)]
    assert list(stream) == []  # exhausted stays exhausted


def test_generate_with_logprobs_collects_them(client: Client, fake: FakeDaemon) -> None:
    result = client.generate("abc", logprobs=True)
    assert result.text == "ABC" and result.logprobs == [0.0, -0.5, -1.0]
    assert fake.messages(GenerateRequest)[0].stream  # only token chunks carry logprobs


@pytest.mark.parametrize("code", [ErrorCode.UNKNOWN_ADAPTER, ErrorCode.OVERLOADED, ErrorCode.PROMPT_TOO_LONG])
def test_daemon_errors_raise_loraplex_error(client: Client, code: ErrorCode) -> None:
    with pytest.raises(LoraplexError) as info:
        client.generate(f"fail:{code.value}", request_id="my-req-1")
    assert info.value.code is code and info.value.request_id == "my-req-1"
    assert info.value.message == "refused by the fake"
    stream = client.stream(f"fail:{code.value}")
    with pytest.raises(LoraplexError) as info:
        next(stream)
    assert info.value.code is code and info.value.request_id == stream.request_id


def test_bad_arguments_raise_value_error(client: Client, fake: FakeDaemon) -> None:
    with pytest.raises(ValueError, match="temperature"):
        client.generate("x", temperature=-1.0)
    with pytest.raises(ValueError, match="timeout"):
        client.generate("x", timeout=0)
    with pytest.raises(TypeError):
        client.generate(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Client("http://localhost:1")
    assert fake.messages(GenerateRequest) == []


def test_duplicate_request_id_is_refused_locally(client: Client, fake: FakeDaemon) -> None:
    with client.stream("hang", request_id="same") as first:
        with pytest.raises(LoraplexError) as info:
            client.generate("x", request_id="same")
        assert info.value.code is ErrorCode.DUPLICATE_REQUEST and first.request_id == "same"


def test_request_ids_are_unique_and_prefixed() -> None:
    ids = {new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000 and all(i.startswith("lpx-") and len(i) == 36 for i in ids)


def test_sync_client_is_safe_from_many_threads(client: Client, fake: FakeDaemon) -> None:
    def work(worker: int) -> None:
        for i in range(10):
            prompt = f"w{worker}-{i}"
            if i % 3 == 0:
                stream = client.stream(prompt, max_tokens=20)
                text = "".join(c.text for c in stream)
                assert stream.result is not None and text == stream.result.text == prompt.upper()
            else:
                assert client.generate(prompt, max_tokens=20).text == prompt.upper()

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(work, w) for w in range(8)]:
            future.result(timeout=WAIT_S)
    assert len(fake.messages(GenerateRequest)) == 80
    assert len(fake.identities()) == 1  # one socket for all threads


def test_interleaved_replies_reach_their_own_callers(client: Client) -> None:
    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(client.generate, f"batch:10:{i}", max_tokens=50) for i in range(10)]
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert [r.text for r in results] == [f"BATCH:10:{i}" for i in range(10)]


def test_cancel_sends_cancel_and_the_generate_returns_cancelled(client: Client, fake: FakeDaemon) -> None:
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.generate, "hang", request_id="to-cancel", timeout=WAIT_S)
        fake.wait_for(is_generate("hang"))
        client.cancel("to-cancel")
        result = future.result(timeout=WAIT_S)
    assert result.finish_reason == "cancelled" and result.request_id == "to-cancel"
    assert [m.request_id for m in fake.messages(CancelRequest)] == ["to-cancel"]


def test_breaking_out_of_a_stream_sends_cancel(client: Client, fake: FakeDaemon) -> None:
    for chunk in client.stream("drip", request_id="drip-1"):
        assert chunk.text == "DR"
        break
    fake.wait_for(lambda m: isinstance(m, CancelRequest) and m.request_id == "drip-1")
    with client.stream("drip", request_id="drip-2") as stream:
        next(stream)
    fake.wait_for(lambda m: isinstance(m, CancelRequest) and m.request_id == "drip-2")
    # A stream read to its end sends no cancel.
    assert list(client.stream("done quickly", request_id="whole"))
    assert client.ping() >= 0
    assert "whole" not in {m.request_id for m in fake.messages(CancelRequest)}


def test_timeout_raises_timeout_and_cancels(client: Client, fake: FakeDaemon) -> None:
    started = time.monotonic()
    with pytest.raises(LoraplexError) as info:
        client.generate("hang", timeout=0.3)
    assert 0.25 < time.monotonic() - started < 2.0
    assert info.value.code is ErrorCode.TIMEOUT
    sent = fake.messages(GenerateRequest)[0]
    assert sent.deadline_ms == 300.0 and info.value.request_id == sent.request_id
    fake.wait_for(lambda m: isinstance(m, CancelRequest) and m.request_id == sent.request_id)
    stream = client.stream("drip", timeout=0.3)
    assert next(stream).index == 0
    with pytest.raises(LoraplexError) as info:
        next(stream)
    assert info.value.code is ErrorCode.TIMEOUT
    fake.wait_for(lambda m: isinstance(m, CancelRequest) and m.request_id == stream.request_id)


def test_daemon_death_fails_in_flight_requests_promptly(fake: FakeDaemon, runtime_dir: Path) -> None:
    with Client(runtime_dir=runtime_dir, liveness=Liveness(probe_after_s=30, probe_timeout_s=30)) as c:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(c.generate, "hang")
            fake.wait_for(is_generate("hang"))
            started = time.monotonic()
            fake.stop()
            with pytest.raises(LoraplexError) as info:
                future.result(timeout=WAIT_S)
        assert info.value.code is ErrorCode.UNAVAILABLE and "lost the connection" in info.value.message
        assert time.monotonic() - started < 2.0


def test_hung_daemon_is_detected_by_ping(fake: FakeDaemon, runtime_dir: Path) -> None:
    with Client(runtime_dir=runtime_dir, liveness=FAST) as c:
        # A slow request on a daemon that answers pings is left alone...
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(c.generate, "hang", request_id="slow")
            time.sleep(1.0)
            assert not future.done()
            c.cancel("slow")
            assert future.result(timeout=WAIT_S).finish_reason == "cancelled"
        probes = fake.messages(PingRequest)
        assert len(probes) >= 2 and all(p.request_id.startswith("lpx-probe-") for p in probes)
        # ...but when nothing answers, in-flight requests fail.
        fake.mute = True
        started = time.monotonic()
        with pytest.raises(LoraplexError) as info:
            c.generate("hang")
        assert info.value.code is ErrorCode.UNAVAILABLE and "not answering" in info.value.message
        assert 0.4 < time.monotonic() - started < 2.0


def test_no_daemon_fails_fast(tmp_path: Path) -> None:
    with Client(ipc_endpoint(tmp_path, "client")) as c:
        started = time.monotonic()
        with pytest.raises(LoraplexError) as info:
            c.generate("hello")
        assert info.value.code is ErrorCode.UNAVAILABLE and "no loraplex daemon" in info.value.message
        with pytest.raises(LoraplexError):
            c.ping()
        assert time.monotonic() - started < 0.5


def test_close_fails_and_cancels_in_flight_requests(fake: FakeDaemon, runtime_dir: Path) -> None:
    c = Client(runtime_dir=runtime_dir)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(c.generate, "hang", request_id="orphan")
        fake.wait_for(is_generate("hang"))
        c.close()
        with pytest.raises(LoraplexError) as info:
            future.result(timeout=WAIT_S)
    assert info.value.code is ErrorCode.UNAVAILABLE and "closed" in info.value.message
    fake.wait_for(lambda m: isinstance(m, CancelRequest) and m.request_id == "orphan")
    c.close()  # idempotent
    with pytest.raises(LoraplexError) as info:
        c.generate("x")
    assert info.value.code is ErrorCode.UNAVAILABLE


def test_adapters_stats_and_ping(client: Client) -> None:
    adapters = client.adapters()
    assert adapters == [AdapterInfo("qv-r8", "/models/qv-r8", 8, ("q_proj", "v_proj"), "host", {"pinned": False})]
    assert client.stats() == {"running": 0, "socket": "x"}
    assert 0 <= client.ping() < 1.0


def test_endpoint_discovery_from_the_runtime_dir(
    fake: FakeDaemon, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAPLEX_RUNTIME_DIR", str(runtime_dir))
    with Client() as c, AdminClient() as admin:
        assert c.endpoint == endpoints(runtime_dir).client and admin.endpoint == endpoints(runtime_dir).admin
        assert c.generate("hi").text == "HI"
        assert admin.drain(timeout_s=1.0) == {"op": "drain"}
    assert fake.messages(DrainRequest, socket="admin")[0].timeout_s == 1.0
    explicit = endpoints(runtime_dir).client
    with Client(explicit, runtime_dir="/nonexistent") as c:
        assert c.endpoint == explicit and c.ping() >= 0


def test_admin_calls_send_admin_messages(fake: FakeDaemon, runtime_dir: Path) -> None:
    with AdminClient(runtime_dir=runtime_dir) as admin:
        assert admin.add_adapter("new", Path("/models/new")) == {"op": "add_adapter"}
        assert admin.remove_adapter("old") == {"op": "remove_adapter"}
        admin.pin_adapter("hot")
        admin.unpin_adapter("hot")
        admin.set_policy("scheduler", "mlq")
        with pytest.raises(LoraplexError) as info:
            admin.add_adapter("dup", "/models/dup")
        assert info.value.code is ErrorCode.ALREADY_EXISTS
        assert admin.adapters()[0].name == "qv-r8" and admin.ping() >= 0
    add = fake.messages(AddAdapterRequest, socket="admin")
    assert [(m.name, m.path) for m in add] == [("new", "/models/new"), ("dup", "/models/dup")]
    assert fake.messages(RemoveAdapterRequest, socket="admin")[0].name == "old"
    pins = fake.messages(PinAdapterRequest, socket="admin")
    assert [(m.name, m.pinned) for m in pins] == [("hot", True), ("hot", False)]
    policy = fake.messages(SetPolicyRequest, socket="admin")[0]
    assert (policy.kind, policy.name) == ("scheduler", "mlq")
    assert fake.messages(GenerateRequest) == [] and fake.messages(AddAdapterRequest) == []


# -- asyncio client ------------------------------------------------------------

@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_async_many_concurrent_requests_over_one_socket(fake: FakeDaemon, runtime_dir: Path, use_uvloop: bool) -> None:
    async def one(c: AsyncClient, i: int) -> tuple[str, str]:
        prompt = f"batch:50:{i}"
        if i % 2:
            stream = c.stream(prompt, max_tokens=50)
            text = "".join([chunk.text async for chunk in stream])
            assert stream.result is not None and stream.result.text == text
            return prompt, text
        return prompt, (await c.generate(prompt, max_tokens=50)).text

    async def scenario() -> None:
        async with AsyncClient(runtime_dir=runtime_dir) as c:
            for prompt, text in await asyncio.gather(*(one(c, i) for i in range(50))):
                assert text == prompt.upper()

    run_async(scenario, use_uvloop)
    assert len(fake.messages(GenerateRequest)) == 50 and len(fake.identities()) == 1


def test_async_generate_stream_errors_and_control_calls(fake: FakeDaemon, runtime_dir: Path) -> None:
    async def scenario() -> None:
        async with AsyncClient(runtime_dir=runtime_dir) as c:
            result = await c.generate([1, 2], adapter="qv-r8", logprobs=True)
            assert (result.token_ids, result.logprobs) == ([2, 1], [0.0, -0.5])
            assert result.timings["adapter_path"] == "cached"
            async with c.stream("abcde") as stream:
                chunks = [chunk async for chunk in stream]
            assert [ch.index for ch in chunks] == [0, 2, 4] and stream.finished_result().text == "ABCDE"
            with pytest.raises(LoraplexError) as info:
                await c.generate("fail:unknown_adapter", request_id="bad-1")
            assert info.value.code is ErrorCode.UNKNOWN_ADAPTER and info.value.request_id == "bad-1"
            assert (await c.adapters())[0].rank == 8
            assert await c.stats() == {"running": 0, "socket": "x"}
            assert await c.ping() >= 0

    run_async(scenario)


def test_async_cancel_break_and_timeout_send_cancel(fake: FakeDaemon, runtime_dir: Path) -> None:
    async def scenario() -> None:
        async with AsyncClient(runtime_dir=runtime_dir) as c:
            task = asyncio.ensure_future(c.generate("hang", request_id="a-cancel"))
            await asyncio.to_thread(fake.wait_for, is_generate("hang"))
            await c.cancel("a-cancel")
            assert (await task).finish_reason == "cancelled"

            async for _ in c.stream("drip", request_id="a-break"):
                break
            await asyncio.to_thread(fake.wait_for, lambda m: isinstance(m, CancelRequest) and m.request_id == "a-break")

            stream = c.stream("drip", request_id="a-close")
            await stream.__anext__()
            await stream.aclose()

            with pytest.raises(LoraplexError) as info:
                await c.generate("hang", timeout=0.2, request_id="a-timeout")
            assert info.value.code is ErrorCode.TIMEOUT

            waiter = asyncio.ensure_future(c.generate("hang", request_id="a-task"))
            await asyncio.sleep(0.1)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter

    run_async(scenario)
    for rid in ("a-cancel", "a-close", "a-timeout", "a-task"):
        fake.wait_for(lambda m, rid=rid: isinstance(m, CancelRequest) and m.request_id == rid)


def test_async_daemon_loss_and_hang_fail_in_flight(fake: FakeDaemon, runtime_dir: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with AsyncClient(runtime_dir=runtime_dir, liveness=FAST) as c:
            fake.mute = True
            started = time.monotonic()
            with pytest.raises(LoraplexError) as info:
                await c.generate("hang")
            assert info.value.code is ErrorCode.UNAVAILABLE and "not answering" in info.value.message
            assert time.monotonic() - started < 2.0
            fake.mute = False
            task = asyncio.ensure_future(c.generate("hang"))
            first = info.value.request_id
            await asyncio.to_thread(fake.wait_for, lambda m: is_generate("hang")(m) and m.request_id != first)
            started = time.monotonic()
            await asyncio.to_thread(fake.stop)
            with pytest.raises(LoraplexError) as info:
                await task
            assert info.value.code is ErrorCode.UNAVAILABLE and time.monotonic() - started < 2.0
        async with AsyncClient(ipc_endpoint(tmp_path, "nothing")) as c:
            with pytest.raises(LoraplexError) as info:
                await c.ping()
            assert info.value.code is ErrorCode.UNAVAILABLE

    run_async(scenario)


def test_async_admin_client(fake: FakeDaemon, runtime_dir: Path) -> None:
    async def scenario() -> None:
        async with AsyncAdminClient(runtime_dir=runtime_dir) as admin:
            assert await admin.add_adapter("n1", "/m/n1") == {"op": "add_adapter"}
            await admin.remove_adapter("n1")
            await admin.pin_adapter("n2")
            await admin.unpin_adapter("n2")
            await admin.set_policy("cache", "lru")
            await admin.drain(0.5)
            with pytest.raises(LoraplexError) as info:
                await admin.add_adapter("dup", "/m/dup")
            assert info.value.code is ErrorCode.ALREADY_EXISTS

    run_async(scenario)
    kinds = [type(m) for _, _, m in fake.received]
    assert kinds == [AddAdapterRequest, RemoveAdapterRequest, PinAdapterRequest, PinAdapterRequest,
                     SetPolicyRequest, DrainRequest, AddAdapterRequest]
    assert all(name == "admin" for name, _, _ in fake.received)
