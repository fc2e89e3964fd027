"""The typed socket wrapper over real ZMQ sockets on ipc:// endpoints in tmp_path."""
from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from pathlib import Path
from typing import Iterator

import pytest
import uvloop
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from loraplex.ipc.codec import DecodeLimits
from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.protocol import ErrorReply, GenerateRequest, PingRequest, PongReply, StatsReply
from loraplex.ipc.runtime_dir import (
    RuntimeDirError,
    default_runtime_dir,
    endpoints,
    ensure_runtime_dir,
    instance_id,
    ipc_endpoint,
)
from loraplex.ipc.socket_options import EndpointInUse, SocketLimits
from loraplex.ipc.sockets import PeerUnavailable, make_dealer, make_pub, make_router, make_sub

WAIT_MS = 2000


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return ipc_endpoint(tmp_path / "run", "client")


def _serve_one(server, timeout_ms: int = WAIT_MS) -> bytes:
    """Answer one ping with a pong; return the client's identity."""
    identity, msg = server.recv(timeout_ms)
    assert isinstance(msg, PingRequest)
    server.send(PongReply(request_id=msg.request_id), identity)
    assert identity is not None
    return identity


def test_request_round_trip(ctx: zmq.Context, endpoint: str) -> None:
    with make_router(ctx, endpoint) as server, make_dealer(ctx, endpoint) as client:
        req = GenerateRequest(request_id="g1", prompt_token_ids=[1, 2, 3], stream=True, temperature=0.0)
        client.send(req)
        identity, got = server.recv(WAIT_MS)
        assert got == req and isinstance(identity, bytes) and identity
        server.send(PongReply(request_id="g1"), identity)
        ident, reply = client.recv(WAIT_MS)
        assert ident is None and reply == PongReply(request_id="g1")


def test_socket_options_are_applied(ctx: zmq.Context, endpoint: str) -> None:
    limits = SocketLimits(decode=DecodeLimits(max_message_bytes=65536), sndhwm=7, rcvhwm=9, linger_ms=3,
                          heartbeat_ivl_ms=500, heartbeat_timeout_ms=1500, heartbeat_ttl_ms=3000)
    with make_router(ctx, endpoint, limits=limits) as server:
        sock = server.socket
        assert sock.getsockopt(zmq.LINGER) == 3
        assert (sock.getsockopt(zmq.SNDHWM), sock.getsockopt(zmq.RCVHWM)) == (7, 9)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == 65536
        assert sock.getsockopt(zmq.IPV6) == 0
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 500
        assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 1500
        assert sock.getsockopt(zmq.HEARTBEAT_TTL) == 3000
    with pytest.raises(ValueError, match="sndhwm"):
        SocketLimits(sndhwm=0)
    with pytest.raises(ValueError, match="linger_ms"):
        SocketLimits(linger_ms=True)


def test_file_modes(ctx: zmq.Context, tmp_path: Path) -> None:
    run_dir = tmp_path / "fresh" / "run"
    with make_router(ctx, ipc_endpoint(run_dir, "admin")):
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        sock_file = run_dir / "admin.sock"
        assert stat.S_ISSOCK(os.stat(sock_file).st_mode)
        assert stat.S_IMODE(os.stat(sock_file).st_mode) == 0o600
    assert not sock_file.exists()


def test_garbage_frame_answers_only_its_sender(ctx: zmq.Context, endpoint: str) -> None:
    with make_router(ctx, endpoint) as server, make_dealer(ctx, endpoint) as bad, make_dealer(ctx, endpoint) as good:
        good.send(PingRequest(request_id="warmup"))
        good_identity = _serve_one(server)
        assert good.recv(WAIT_MS).message == PongReply(request_id="warmup")

        bad.socket.send(b"\xc1 definitely not msgpack")
        with pytest.raises(ProtocolError) as info:
            server.recv(WAIT_MS)
        err = info.value
        assert err.code is ErrorCode.BAD_MESSAGE and err.identity is not None and err.identity != good_identity
        server.send(ErrorReply.from_error(err), err.identity)

        # An extra frame is a framing error, also pinned to its sender.
        bad.socket.send_multipart([b"x", b"y"])
        with pytest.raises(ProtocolError) as info:
            server.recv(WAIT_MS)
        assert info.value.code is ErrorCode.BAD_MESSAGE and info.value.identity == err.identity

        good.send(PingRequest(request_id="after"))
        assert _serve_one(server) == good_identity
        assert good.recv(WAIT_MS).message == PongReply(request_id="after")
        # The error went to the bad client and nowhere else.
        assert not good.poll(100)
        reply = bad.recv(WAIT_MS).message
        assert isinstance(reply, ErrorReply) and reply.error_code is ErrorCode.BAD_MESSAGE


def test_oversized_message_disconnects_only_that_peer(ctx: zmq.Context, endpoint: str) -> None:
    small = SocketLimits(decode=DecodeLimits(max_message_bytes=4096))
    with make_router(ctx, endpoint, limits=small) as server:
        monitor = server.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            with make_dealer(ctx, endpoint) as big, make_dealer(ctx, endpoint, limits=small) as other:
                # The big client's own limit is the default 8 MiB, so the frame leaves it.
                big.send(GenerateRequest(request_id="huge", prompt="x" * 20_000))
                assert monitor.poll(WAIT_MS), "server never dropped the oversized peer"
                assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
                with pytest.raises(TimeoutError):
                    server.recv(100)
                other.send(PingRequest(request_id="still-up"))
                _serve_one(server)
                assert other.recv(WAIT_MS).message == PongReply(request_id="still-up")
                # The dropped client reconnects by itself and is served again.
                deadline = time.monotonic() + 5
                while not server.poll(0):
                    assert time.monotonic() < deadline, "dropped client never came back"
                    big.send(PingRequest(request_id="back"))
                    server.poll(100)
                _serve_one(server)
                assert big.recv(WAIT_MS).message == PongReply(request_id="back")
        finally:
            monitor.close(linger=0)


def test_sender_refuses_what_the_peer_would_drop(ctx: zmq.Context, endpoint: str) -> None:
    small = SocketLimits(decode=DecodeLimits(max_message_bytes=1024))
    with make_router(ctx, endpoint) as server, make_dealer(ctx, endpoint, limits=small) as client:
        with pytest.raises(ProtocolError) as info:
            client.send(GenerateRequest(request_id="r", prompt="x" * 2000))
        assert info.value.code is ErrorCode.TOO_LARGE
        assert not server.poll(50)


def test_router_send_to_unknown_peer_raises(ctx: zmq.Context, endpoint: str) -> None:
    with make_router(ctx, endpoint) as server:
        with pytest.raises(PeerUnavailable) as info:
            server.send(PongReply(), b"\x00nobody")
        assert info.value.identity == b"\x00nobody"
        with pytest.raises(ValueError):
            server.send(PongReply())


def test_recv_times_out(ctx: zmq.Context, endpoint: str) -> None:
    with make_router(ctx, endpoint) as server:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            server.recv(50)
        assert time.monotonic() - start < 1.0


def test_live_endpoint_is_not_stolen_but_stale_file_is_replaced(ctx: zmq.Context, tmp_path: Path) -> None:
    run_dir = ensure_runtime_dir(tmp_path / "run")
    ep = ipc_endpoint(run_dir, "client")
    with make_router(ctx, ep):
        with pytest.raises(EndpointInUse):
            make_router(ctx, ep)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(run_dir / "client.sock"))
    stale.close()  # leaves the file behind, as a crashed daemon would
    with make_router(ctx, ep) as server, make_dealer(ctx, ep) as client:
        client.send(PingRequest(request_id="p"))
        _serve_one(server)
        assert client.recv(WAIT_MS).message == PongReply(request_id="p")
    (run_dir / "plain.sock").write_text("not a socket")
    with pytest.raises(EndpointInUse):
        make_router(ctx, ipc_endpoint(run_dir, "plain"))


def test_pub_sub(ctx: zmq.Context, tmp_path: Path) -> None:
    ep = ipc_endpoint(tmp_path / "run", "stats")
    with make_pub(ctx, ep) as pub, make_sub(ctx, ep) as sub:
        snapshot = StatsReply(stats={"queue_depth": 4, "pages_free": 0.25})
        deadline = time.monotonic() + 3
        # A subscriber misses what was published before it joined: publish
        # until it hears something.
        while not sub.poll(20):
            assert time.monotonic() < deadline, "subscriber never received"
            pub.send(snapshot)
        assert sub.recv(0) == (None, snapshot)
        with pytest.raises(TypeError):
            pub.recv(0)
        with pytest.raises(TypeError):
            sub.send(snapshot)


def test_asyncio_flavour_under_uvloop(tmp_path: Path) -> None:
    ep = ipc_endpoint(tmp_path / "run", "client")

    async def scenario() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        actx = zmq.asyncio.Context()
        try:
            async with make_router(actx, ep) as server, make_dealer(actx, ep) as client, make_dealer(actx, ep) as bad:
                await client.send(GenerateRequest(request_id="a1", prompt="hello", max_tokens=3))
                identity, msg = await server.recv(WAIT_MS)
                assert isinstance(msg, GenerateRequest) and msg.prompt == "hello"
                await server.send(PongReply(request_id="a1"), identity)
                assert (await client.recv(WAIT_MS)).message == PongReply(request_id="a1")

                await bad.socket.send(b"\x92\x01")  # truncated array
                with pytest.raises(ProtocolError) as info:
                    await server.recv(WAIT_MS)
                assert info.value.identity not in (None, identity)
                await server.send(ErrorReply.from_error(info.value), info.value.identity)
                reply = (await bad.recv(WAIT_MS)).message
                assert isinstance(reply, ErrorReply) and reply.code == "bad_message"

                with pytest.raises(TimeoutError):
                    await server.recv(30)
                with pytest.raises(PeerUnavailable):
                    await server.send(PongReply(), b"\x00gone")
        finally:
            actx.destroy(linger=0)

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(scenario(), timeout=10))
    finally:
        loop.close()


def test_runtime_dir_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_RUNTIME_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert default_runtime_dir() == tmp_path / "explicit"
    monkeypatch.delenv("LORAPLEX_RUNTIME_DIR")
    assert default_runtime_dir() == tmp_path / "xdg" / "loraplex"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_runtime_dir() == Path(f"/tmp/loraplex-{os.getuid()}")


def test_endpoints_and_instance_ids(tmp_path: Path) -> None:
    eps = endpoints(tmp_path)
    assert eps.client == f"ipc://{tmp_path}/client.sock"
    assert eps.admin == f"ipc://{tmp_path}/admin.sock"
    assert eps.stats == f"ipc://{tmp_path}/stats.sock"
    assert eps.socket_paths == (tmp_path / "client.sock", tmp_path / "admin.sock", tmp_path / "stats.sock")
    assert eps.instance_id == instance_id(tmp_path) and len(eps.instance_id) == 12
    assert instance_id(tmp_path / "a") != instance_id(tmp_path / "b")
    with pytest.raises(ValueError, match="longer than"):
        ipc_endpoint(tmp_path / ("d" * 120), "client")
    with pytest.raises(ValueError):
        ipc_endpoint(tmp_path, "../escape")


def test_unsafe_runtime_dirs_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(RuntimeDirError, match="writable"):
        ensure_runtime_dir(shared)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    ensure_runtime_dir(readable)
    assert stat.S_IMODE(os.stat(readable).st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(readable)
    with pytest.raises(RuntimeDirError, match="symlink"):
        ensure_runtime_dir(link)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(RuntimeDirError, match="not a directory"):
        ensure_runtime_dir(afile)
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(RuntimeDirError, match="owned by uid"):
        ensure_runtime_dir(readable)


def test_runtime_dir_opened_to_a_group_for_entering_only_is_kept(tmp_path: Path) -> None:
    """server.admin_group sets 0710 (its members may enter, not list); any other looser mode is tightened."""
    entered = tmp_path / "entered"
    entered.mkdir()
    os.chmod(entered, 0o710)
    ensure_runtime_dir(entered)
    assert stat.S_IMODE(os.stat(entered).st_mode) == 0o710
    for loose in (0o750, 0o711, 0o701):
        os.chmod(entered, loose)
        ensure_runtime_dir(entered)
        assert stat.S_IMODE(os.stat(entered).st_mode) == 0o700
