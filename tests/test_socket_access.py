"""Who may reach the daemon: admin.sock stricter than client.sock and
optionally opened to server.admin_group; no plaintext TCP listener on a non-loopback address
unless server.tcp_insecure (and then a warning); TCP clients never see server file paths."""
from __future__ import annotations

import grp
import os
import re
import stat
from pathlib import Path

import pytest

from loraplex.contracts.host import free_loopback_port
from loraplex.daemon.access import REDACTED, redact_for_remote
from loraplex.daemon.config import ConfigError, ServerSettings
from loraplex.daemon.config_names import is_loopback_endpoint
from loraplex.ipc.client import Client
from loraplex.ipc.protocol import AdaptersReply, ErrorReply, StatsReply, TokenChunk
from tests.daemon_process import DaemonProcess

ABSOLUTE_PATH = re.compile(r"(?<![\w:/.-])/[\w.-]+/")



def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.9.0.3:5555", True), ("tcp://localhost:1", True),
    ("tcp://[::1]:80", True), ("tcp://*:5555", False), ("tcp://0.0.0.0:5555", False), ("tcp://10.0.0.7:5555", False),
    ("tcp://gpu-host:5555", False), ("tcp://eth0:5555", False), ("tcp://[::]:5555", False),
])
def test_loopback_endpoints(endpoint: str, loopback: bool) -> None:
    assert is_loopback_endpoint(endpoint) is loopback
    if loopback:
        ServerSettings(tcp_listen=endpoint)
    else:
        with pytest.raises(ConfigError, match="tcp_insecure"):
            ServerSettings(tcp_listen=endpoint)
        assert ServerSettings(tcp_listen=endpoint, tcp_insecure=True).tcp_insecure


def test_redaction_keeps_what_is_not_a_path() -> None:
    entry = {"name": "sql", "path": "/srv/adapters/sql", "rank": 8, "target_modules": ["q_proj"], "state": "error",
             "error": "cannot read /srv/adapters/sql/adapter_model.safetensors: header too large"}
    adapters = redact_for_remote(AdaptersReply(adapters=[entry]))
    assert adapters.adapters[0]["path"] == REDACTED
    assert adapters.adapters[0]["error"] == f"cannot read {REDACTED}: header too large"
    stats = redact_for_remote(StatsReply(stats={"engine": {"model_dir": "/m/llama", "rate": "12 tokens/s"},
                                                "endpoint": "tcp://10.0.0.1:5555", "home": "~/.cache/x y"}))
    assert stats.stats == {"engine": {"model_dir": REDACTED, "rate": "12 tokens/s"},
                           "endpoint": "tcp://10.0.0.1:5555", "home": f"{REDACTED} y"}
    error = redact_for_remote(ErrorReply(request_id="r", code="invalid_adapter", message="'/a/b' is bad"))
    assert error.message == f"'{REDACTED}' is bad"
    chunk = TokenChunk(request_id="r", token_ids=[1], text="see /etc/x", index=0)
    assert redact_for_remote(chunk) is chunk  # model output is the client's


def test_socket_modes_plaintext_tcp_warning_and_redacted_paths(demo, tmp_path: Path) -> None:
    endpoint = f"tcp://0.0.0.0:{free_loopback_port()}"
    proc = DaemonProcess(tmp_path, env={"LORAPLEX_SERVER_TCP_LISTEN": endpoint,
                                        "LORAPLEX_SERVER_TCP_INSECURE": "true"})
    try:
        proc.start()
        rt = proc.runtime_dir
        assert _mode(rt) == 0o700
        assert _mode(rt / "admin.sock") == 0o600
        assert _mode(rt / "client.sock") == _mode(rt / "stats.sock") == 0o660
        assert re.search(r"WARNING server.tcp_insecure: tcp://0\.0\.0\.0:\d+ has no CURVE keys", proc.log())
        with proc.client() as local:
            local_paths = [a.path for a in local.adapters()]
            assert local_paths and all(p.startswith("/") for p in local_paths)
        with Client(endpoint.replace("0.0.0.0", "127.0.0.1")) as remote:
            adapters = remote.adapters(timeout=10)
            assert {a.name for a in adapters} and {a.path for a in adapters} == {REDACTED}
            assert not [s for s in _strings([a.extra for a in adapters]) if ABSOLUTE_PATH.search(s)]
            stats = remote.stats(timeout=10)
            assert not [s for s in _strings(stats) if ABSOLUTE_PATH.search(s)]
            out = remote.generate("Once upon a time", max_tokens=3, temperature=0.0, ignore_eos=True, timeout=60)
            assert len(out.token_ids) == 3
    finally:
        assert proc.stop() == 0, proc.log()


def test_admin_group_opens_admin_sock_to_that_group_only(demo, tmp_path: Path) -> None:
    group = grp.getgrgid(os.getegid()).gr_name  # one the test's user may give files to
    proc = DaemonProcess(tmp_path, env={"LORAPLEX_SERVER_ADMIN_GROUP": group})
    try:
        proc.start()
        rt = proc.runtime_dir
        admin = os.stat(rt / "admin.sock")
        assert stat.S_IMODE(admin.st_mode) == 0o660 and admin.st_gid == os.getegid()
        assert _mode(rt) == 0o710 and os.stat(rt).st_gid == os.getegid()
        assert _mode(rt / "client.sock") == 0o660
    finally:
        assert proc.stop() == 0, proc.log()
    assert _mode(rt) == 0o710  # kept by the next start's checks ...
    proc = DaemonProcess(tmp_path)
    try:
        proc.start()
        assert _mode(rt) == 0o700 and _mode(rt / "admin.sock") == 0o600  # ... and closed without admin_group
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("env, message", [
    ({"LORAPLEX_SERVER_TCP_LISTEN": "tcp://0.0.0.0:{port}"}, r"reachable from other hosts and has no CURVE keys"),
    ({"LORAPLEX_SERVER_ADMIN_GROUP": "no-such-group-lpx"}, r"there is no group 'no-such-group-lpx'"),
])
def test_unsafe_or_impossible_access_refuses_to_start(tmp_path: Path, env: dict[str, str], message: str) -> None:
    env = {k: v.format(port=free_loopback_port()) for k, v in env.items()}
    proc = DaemonProcess(tmp_path, env=env)
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            proc.start(timeout_s=60)
    finally:
        proc.stop()  # a daemon that did start must not outlive the test
    assert re.search(message, proc.log()), proc.log()
    assert not list(proc.runtime_dir.glob("*.sock")) if proc.runtime_dir.exists() else True
