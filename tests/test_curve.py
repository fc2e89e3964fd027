"""CURVE with a key allow-list on tcp listeners: key files and their checks, the
socket layer (a CURVE ROUTER behind the ZAP authenticator), and a real daemon
serving `server.tcp_listen` to allowed, unknown-key and plaintext clients."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import uvloop
import zmq
import zmq.asyncio

from loraplex import cli
from loraplex.contracts.host import free_loopback_port
from loraplex.daemon.config import ConfigError
from loraplex.daemon.config_load import load_config
from loraplex.ipc.client import AsyncClient, Client, ErrorCode, LoraplexError
from loraplex.ipc.curve import (
    CurveClientKeys,
    CurveError,
    CurveServerKeys,
    generate_key_pair,
    read_allowed_keys,
    read_secret_key,
    start_authenticator,
)
from loraplex.ipc.protocol import PingRequest, PongReply
from loraplex.ipc.sockets import make_router
from tests.daemon_process import DaemonProcess

REFUSED_WITHIN_S = 5.0


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A server pair, an allowed client pair (its .pub in clients/) and a stranger's pair."""
    out = {}
    for name, where in (("server", "server"), ("alice", "alice"), ("mallory", "mallory")):
        pub, key = generate_key_pair(tmp_path / where, name)
        out[f"{name}.pub"], out[f"{name}.key"] = pub, key
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "alice.pub").write_text(out["alice.pub"].read_text())
    out["clients"] = clients
    return out


def client_keys(keys: dict[str, Path], who: str) -> CurveClientKeys:
    return CurveClientKeys.from_files(keys["server.pub"], keys[f"{who}.key"])


# -- key files ----------------------------------------------------------------------------------

def test_generated_key_files_round_trip(keys: dict[str, Path]) -> None:
    assert keys["server.key"].stat().st_mode & 0o777 == 0o600
    public, secret = read_secret_key(keys["server.key"])
    assert len(public) == len(secret) == 40 and public.decode() in keys["server.pub"].read_text()
    server = CurveServerKeys.from_files(keys["server.key"], keys["clients"])
    assert server.public_key == public and server.allowed == {client_keys(keys, "alice").public_key}
    assert secret.decode() not in repr(server) and secret.decode() not in repr(client_keys(keys, "alice"))
    with pytest.raises(CurveError, match="already exists"):
        generate_key_pair(keys["server.key"].parent, "server")


def test_allow_list_file_holds_one_key_per_line(keys: dict[str, Path], tmp_path: Path) -> None:
    listing = tmp_path / "allowed.txt"
    listing.write_text("# team\n" + keys["alice.pub"].read_text() + keys["mallory.pub"].read_text() + "\n")
    assert len(read_allowed_keys(listing)) == 2


@pytest.mark.parametrize("case, message", [
    ("world_readable", r"accessible to other users \(mode 0644\); run: chmod 600"),
    ("missing", r"does not exist"),
    ("bad_key", r"line 1: not a CURVE key"),
    ("two_keys", r"exactly one key, found 2"),
])
def test_bad_secret_key_files_are_refused(keys: dict[str, Path], case: str, message: str) -> None:
    path = keys["server.key"]
    if case == "world_readable":
        path.chmod(0o644)
    elif case == "missing":
        path = path.with_name("nope.key")
    elif case == "bad_key":
        path.write_text("not-a-key\n")
    else:
        path.write_text(path.read_text() + keys["alice.key"].read_text())
    with pytest.raises(CurveError, match=message):
        read_secret_key(path)


def test_bad_allow_lists_are_refused(keys: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CurveError, match=r"has no \*\.pub files"):
        read_allowed_keys(empty)
    with pytest.raises(CurveError, match="does not exist"):
        read_allowed_keys(tmp_path / "absent")
    (tmp_path / "comments.pub").write_text("# nobody yet\n")
    with pytest.raises(CurveError, match="lists no public keys"):
        read_allowed_keys(tmp_path / "comments.pub")


def test_config_needs_both_curve_settings_and_anchors_their_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tcp_curve_allowed_keys must be set too"):
        load_config(None, env={"LORAPLEX_SERVER_TCP_CURVE_SECRET_KEY_FILE": "/k/server.key"})
    with pytest.raises(ConfigError, match="tcp_curve_secret_key_file must be set too"):
        load_config(None, env={"LORAPLEX_SERVER_TCP_CURVE_ALLOWED_KEYS": "/k/clients"})
    toml = tmp_path / "loraplex.toml"
    toml.write_text('[server]\ntcp_listen = "tcp://127.0.0.1:5555"\n'
                    'tcp_curve_secret_key_file = "curve/server.key"\ntcp_curve_allowed_keys = "curve/clients"\n')
    server = load_config(toml, env={}).server
    assert server.tcp_curve_secret_key_file == str(tmp_path / "curve" / "server.key")
    assert server.tcp_curve_allowed_keys == str(tmp_path / "curve" / "clients")


def test_curve_is_only_for_tcp_endpoints(keys: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tcp:// endpoints only"):
        Client(f"ipc://{tmp_path}/c.sock", curve=client_keys(keys, "alice"))
    with pytest.raises(ValueError, match="tcp:// endpoints only"):
        AsyncClient(f"ipc://{tmp_path}/c.sock", curve=client_keys(keys, "alice"))


# -- socket layer: a CURVE ROUTER behind the ZAP authenticator ------------------------------------

class PingServer:
    """A CURVE ROUTER on 127.0.0.1 answering pings, with the allow-list authenticator, in a uvloop thread."""

    def __init__(self, keys: CurveServerKeys) -> None:
        self._keys = keys
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.endpoint = ""
        self.refused = 0
        self._thread = threading.Thread(target=lambda: uvloop.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the CURVE test server did not start"

    async def _main(self) -> None:
        ctx = zmq.asyncio.Context()
        zap = start_authenticator(ctx, self._keys)
        sock = make_router(ctx, "tcp://127.0.0.1:0", curve=self._keys)
        self.endpoint = sock.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    identity, msg = await sock.recv(timeout_ms=50)
                except TimeoutError:
                    continue
                if isinstance(msg, PingRequest):
                    await sock.send(PongReply(request_id=msg.request_id), identity)
        finally:
            self.refused = zap.refused
            zap.stop()
            sock.close()
            ctx.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def ping_server(keys: dict[str, Path]) -> Iterator[PingServer]:
    server = PingServer(CurveServerKeys.from_files(keys["server.key"], keys["clients"]))
    yield server
    server.stop()


def _refused(call, match: str) -> None:
    started = time.monotonic()
    with pytest.raises(LoraplexError, match=match) as info:
        call()
    assert info.value.code is ErrorCode.UNAVAILABLE
    assert time.monotonic() - started < REFUSED_WITHIN_S


def test_sync_clients_allowed_unknown_and_plaintext(ping_server: PingServer, keys: dict[str, Path]) -> None:
    with Client(ping_server.endpoint, curve=client_keys(keys, "alice")) as alice:
        assert alice.ping(timeout=5) < 5
    with Client(ping_server.endpoint, curve=client_keys(keys, "mallory")) as mallory:
        _refused(lambda: mallory.ping(timeout=30), "refused this client's CURVE key")
        _refused(lambda: mallory.ping(timeout=30), "refused this client's CURVE key")  # fails fast from now on
    with Client(ping_server.endpoint) as plain:
        _refused(lambda: plain.ping(timeout=30), "refused an unencrypted connection")
    wrong_server = CurveClientKeys.from_files(keys["mallory.pub"], keys["alice.key"])
    with Client(ping_server.endpoint, curve=wrong_server) as lost:
        _refused(lambda: lost.ping(timeout=30), "CURVE handshake with the daemon at .* failed")
    ping_server.stop()
    assert ping_server.refused >= 1


def test_async_clients_allowed_and_unknown(ping_server: PingServer, keys: dict[str, Path]) -> None:
    async def scenario() -> None:
        async with AsyncClient(ping_server.endpoint, curve=client_keys(keys, "alice")) as alice:
            assert await alice.ping(timeout=5) < 5
        async with AsyncClient(ping_server.endpoint, curve=client_keys(keys, "mallory")) as mallory:
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(LoraplexError, match="refused this client's CURVE key"):
                    await mallory.ping(timeout=30)
                assert time.monotonic() - started < REFUSED_WITHIN_S

    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_async_refusal_never_waits_for_the_send_timeout(ping_server: PingServer, keys: dict[str, Path]) -> None:
    """With a send timeout far beyond the bound, an unknown key is still refused at once: the async
    client watches the handshake instead of blocking in send until SNDTIMEO (which a loaded host
    showed as a refusal after exactly 5.0 s)."""
    import dataclasses

    from loraplex.ipc.client_core import CLIENT_SOCKET_LIMITS

    limits = dataclasses.replace(CLIENT_SOCKET_LIMITS, send_timeout_ms=60_000)

    async def scenario() -> None:
        for _ in range(3):  # a fresh socket each time: the send races the first handshake
            async with AsyncClient(ping_server.endpoint, curve=client_keys(keys, "mallory"), limits=limits) as mallory:
                started = time.monotonic()
                with pytest.raises(LoraplexError, match="refused this client's CURVE key"):
                    await mallory.ping(timeout=90)
                assert time.monotonic() - started < REFUSED_WITHIN_S

    asyncio.run(asyncio.wait_for(scenario(), 60))


# -- a real daemon ----------------------------------------------------------------------------------


def _curve_env(keys: dict[str, Path], endpoint: str) -> dict[str, str]:
    return {"LORAPLEX_SERVER_TCP_LISTEN": endpoint,
            "LORAPLEX_SERVER_TCP_CURVE_SECRET_KEY_FILE": str(keys["server.key"]),
            "LORAPLEX_SERVER_TCP_CURVE_ALLOWED_KEYS": str(keys["clients"])}


def test_daemon_serves_only_allowed_curve_clients_over_tcp(demo, keys, tmp_path, capsys) -> None:
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    (tmp_path / "d").mkdir()
    proc = DaemonProcess(tmp_path / "d", env=_curve_env(keys, endpoint))
    try:
        proc.start()
        with Client(endpoint, curve=client_keys(keys, "alice")) as alice:
            out = alice.generate([3, 4, 5], max_tokens=4, temperature=0.0, ignore_eos=True, timeout=60)
            assert len(out.token_ids) == 4 and out.finish_reason == "length"
        with Client(endpoint, curve=client_keys(keys, "mallory")) as mallory:
            _refused(lambda: mallory.generate([3, 4, 5], max_tokens=4, timeout=60), "refused this client's CURVE key")
        with Client(endpoint) as plain:
            _refused(lambda: plain.generate([3, 4, 5], max_tokens=4, timeout=60), "refused an unencrypted")
        with proc.client() as local:  # the ipc socket is unchanged: no keys there
            assert local.ping(timeout=5) < 5
        argv = ["generate", "--endpoint", endpoint, "--curve-server-key", str(keys["server.pub"]),
                "--curve-client-key", str(keys["alice.key"]), "--max-tokens", "3", "--ignore-eos", "Once upon"]
        assert cli.main(argv) == 0
        assert "[length; 3 tokens" in capsys.readouterr().err
        argv[argv.index("--curve-client-key") + 1] = str(keys["mallory.key"])
        assert cli.main(argv) == 1
        assert "refused this client's CURVE key" in capsys.readouterr().err
    finally:
        assert proc.stop() == 0, proc.log()
    assert "refused a CURVE client with unknown public key" in proc.log()


@pytest.mark.parametrize("case, message", [
    ("world_readable", "accessible to other users"),
    ("missing_allow_list", "allowed-keys file or directory .* does not exist"),
    ("half_configured", "tcp_curve_allowed_keys must be set too"),
])
def test_daemon_refuses_bad_curve_config(keys, tmp_path, case: str, message: str) -> None:
    env = _curve_env(keys, f"tcp://127.0.0.1:{free_loopback_port()}")
    if case == "world_readable":
        os.chmod(keys["server.key"], 0o644)
    elif case == "missing_allow_list":
        env["LORAPLEX_SERVER_TCP_CURVE_ALLOWED_KEYS"] = str(tmp_path / "absent")
    else:
        del env["LORAPLEX_SERVER_TCP_CURVE_ALLOWED_KEYS"]
    (tmp_path / "d").mkdir()
    proc = DaemonProcess(tmp_path / "d", env=env)
    with pytest.raises(RuntimeError, match="exited with 2"):
        proc.start(timeout_s=60)
    import re

    assert re.search(message, proc.log()), proc.log()
