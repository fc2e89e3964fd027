"""systemd integration: the daemon reports READY, STATUS, WATCHDOG and STOPPING on
$NOTIFY_SOCKET, and its children do not inherit the socket."""
from __future__ import annotations

import socket
import time

from loraplex.daemon.sdnotify import Notifier
from tests.daemon_process import DaemonProcess


def _listen(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    return sock


def _drain(sock: socket.socket, until: float) -> list[str]:
    seen: list[str] = []
    while time.monotonic() < until:
        try:
            seen += sock.recv(4096).decode().split("\n")
        except socket.timeout:
            continue
    return seen


def test_notifier_is_a_no_op_without_systemd():
    notifier = Notifier(env={})
    assert not notifier.enabled and notifier.watchdog_s is None
    assert notifier.notify("READY=1") is False


def test_notifier_watchdog_only_for_our_pid(tmp_path):
    env = {"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}
    assert Notifier(env=env).watchdog_s is None
    env["WATCHDOG_PID"] = ""
    assert Notifier(env=env).watchdog_s == 2.0


def test_daemon_notifies_systemd(demo, tmp_path):
    listener = _listen(tmp_path / "notify.sock")
    proc = DaemonProcess(tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"})
    try:
        proc.start()
        seen = _drain(listener, time.monotonic() + 1.5)
        assert "READY=1" in seen
        assert any(s.startswith("STATUS=serving") for s in seen)
        assert any(s.startswith("EXTEND_TIMEOUT_USEC=") for s in seen)
        assert seen.count("WATCHDOG=1") >= 2
        with proc.client() as client:
            engine_pid = client.stats()["engine"]["pid"]
        with open(f"/proc/{engine_pid}/environ", "rb") as f:
            assert b"NOTIFY_SOCKET" not in f.read(), "the engine inherited NOTIFY_SOCKET"
    finally:
        assert proc.stop() == 0, proc.log()
        seen = _drain(listener, time.monotonic() + 0.5)
        listener.close()
    assert "STOPPING=1" in seen


def test_deploy_files_are_consistent():
    from pathlib import Path

    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.config_toml import example_toml

    root = Path(__file__).resolve().parent.parent / "deploy"
    assert (root / "loraplex.toml").read_text() == example_toml() + "\n"
    load_config(root / "loraplex.toml", env={})
    unit = (root / "loraplex.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "KillMode=mixed", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "RuntimeDirectory=loraplex", "StateDirectory=loraplex", "CacheDirectory=loraplex",
                 "ReadWritePaths=/dev/shm", "CapabilityBoundingSet="):
        assert line in unit.splitlines(), line
    stop = int(next(ln for ln in unit.splitlines() if ln.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop >= load_config(None, env={}).server.drain_timeout_s


def test_sighup_rereads_the_registry_without_dropping_requests(demo, tmp_path):
    import signal
    import threading

    from loraplex.daemon.registry import AdapterRegistry

    listener = _listen(tmp_path / "notify.sock")
    proc = DaemonProcess(tmp_path, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    try:
        proc.start()
        results: list = []
        with proc.client() as client:
            worker = threading.Thread(target=lambda: results.append(client.generate(
                [3, 4, 5], max_tokens=60, temperature=0.0, ignore_eos=True, timeout=120)))
            worker.start()
            with AdapterRegistry(proc.state_dir / "registry.sqlite3") as registry:
                registry.add("hup", str(demo.adapters["kdown-r8"]), source="cli")
            proc.proc.send_signal(signal.SIGHUP)
            worker.join(120)
            deadline = time.monotonic() + 30
            while "hup" not in {a.name for a in client.adapters()}:
                assert time.monotonic() < deadline, "SIGHUP did not pick up the new registry entry"
                time.sleep(0.1)
            out = client.generate([3, 4, 5], adapter="hup", max_tokens=3, temperature=0.0, ignore_eos=True,
                                  timeout=60)
        assert results and len(results[0].token_ids) == 60 and results[0].finish_reason == "length"
        assert len(out.token_ids) == 3
        seen = _drain(listener, time.monotonic() + 0.5)
        assert "RELOADING=1" in seen and any(s.startswith("STATUS=serving") and "reloaded" in s for s in seen)
    finally:
        assert proc.stop() == 0, proc.log()
        listener.close()


def test_watchdog_pings_stop_while_the_loop_is_blocked_and_resume_after(tmp_path):
    """WATCHDOG=1 comes from an asyncio task: a blocked event loop (or an unhealthy
    engine) sends none, so systemd's WatchdogSec fires; pings resume once it runs again."""
    import asyncio
    import threading

    listener = _listen(tmp_path / "notify.sock")
    pings: list[float] = []
    done = threading.Event()

    def receive() -> None:  # timestamps arrivals in another thread, so a blocked loop cannot delay them
        while not done.is_set():
            try:
                if "WATCHDOG=1" in listener.recv(4096).decode().split("\n"):
                    pings.append(time.monotonic())
            except socket.timeout:
                continue

    receiver = threading.Thread(target=receive)
    receiver.start()
    notifier = Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "200000"})
    health = ["ok"]
    marks: dict[str, float] = {}

    def healthy() -> bool:
        if health[0] == "raise":
            raise RuntimeError("health check bug")
        return health[0] == "ok"

    async def phase(name: str, state: str) -> None:
        health[0] = state
        marks[name] = time.monotonic()
        await asyncio.sleep(0.6)

    async def scenario() -> None:
        task = asyncio.create_task(notifier.watchdog(healthy))
        await asyncio.sleep(0.6)
        marks["block"] = time.monotonic()
        time.sleep(1.0)  # the event loop is blocked: no task runs
        await phase("unblock", "ok")
        await phase("unhealthy", "down")
        await phase("raising", "raise")
        await phase("recovered", "ok")
        marks["end"] = time.monotonic()
        task.cancel()

    try:
        asyncio.run(scenario())
        time.sleep(0.2)
    finally:
        done.set()
        receiver.join()
        listener.close()
        notifier.close()

    def count(start: float, end: float) -> int:
        return sum(start <= t < end for t in pings)

    assert count(0, marks["block"]) >= 3, pings  # every 0.1 s while healthy
    assert count(marks["block"] + 0.05, marks["unblock"]) == 0, "a ping left while the loop was blocked"
    assert count(marks["unblock"], marks["unhealthy"]) >= 3, "pings did not resume after the loop unblocked"
    assert count(marks["unhealthy"] + 0.15, marks["recovered"]) == 0, "pings went on while unhealthy"
    assert count(marks["recovered"], marks["end"] + 0.2) >= 3, "a raising health check stopped the watchdog task"
