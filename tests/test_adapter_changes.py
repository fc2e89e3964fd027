"""Admin changes and the registry move together (daemon/adapter_changes.py): a registry write that
fails changes nothing in memory (no adapter served that a restart would lose), and a change the
engine refuses leaves no row behind (or puts the previous one back). The serving core runs over
stub engines; the registry is a real SQLite file whose writes really fail, because another
connection holds its write lock past the registry's busy timeout."""
from __future__ import annotations

import asyncio
import sqlite3
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.stub_engine import StubEngineLink
from loraplex.daemon.child_link import EngineRefused
from loraplex.daemon.config_load import load_config
from loraplex.daemon.registry import AdapterRegistry
from loraplex.daemon.server import Dispatcher
from loraplex.daemon.serving import Rejected, ServingCore
from loraplex.ipc.protocol import (
    AddAdapterRequest,
    EngineFailure,
    EngineLoadAdapter,
    PinAdapterRequest,
    RemoveAdapterRequest,
)


class Engine(StubEngineLink):
    """Loads everything except adapters whose path ends in 'bad'; records the load orders."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.loads: list[str] = []

    async def call(self, order, timeout_s=None):
        if isinstance(order, EngineLoadAdapter):
            self.loads.append(order.name)
            if order.path.endswith("bad"):
                raise EngineRefused(EngineFailure(code="invalid_adapter", message="refused", subject=order.name))
        return await super().call(order, timeout_s)


def _adapter(path: Path, content: bytes = b"weights") -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(content)
    return str(path)


@contextmanager
def writes_fail(db_path: Path):
    """Another connection holds the write lock: every registry write fails (reads go on, WAL)."""
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def run(tmp_path: Path, scenario) -> object:
    async def main():
        config = load_config(None, env={})
        engine = Engine(None, None, {})
        core = ServingCore(config, [engine], send=lambda ident, msg: asyncio.sleep(0))
        await core.start([])
        registry = AdapterRegistry(tmp_path / "state" / "registry.sqlite3", model="m", busy_timeout_s=0.05)
        dispatcher = Dispatcher(core, registry, (), [], on_drain=lambda timeout_s: None)
        try:
            return await scenario(core, registry, dispatcher.handle_admin, engine)
        finally:
            await core.stop()
            registry.close()

    return asyncio.run(main())


async def refused(call, msg) -> Rejected:
    with pytest.raises(Rejected) as err:
        await call(msg)
    return err.value


def test_a_failed_write_registers_nothing_and_serves_nothing(tmp_path):
    path = _adapter(tmp_path / "a")

    async def scenario(core, registry, admin, engine):
        with writes_fail(registry.db_path):
            err = await refused(admin, AddAdapterRequest(name="a", path=path))
            assert err.code == "internal" and "was not registered" in err.message and "nothing changed" in err.message
            assert "a" not in core.adapters and engine.loads == [], "the adapter is served though not registered"
            err = await refused(admin, AddAdapterRequest(name="a", path=path, replace=True))
            assert "a" not in core.adapters and engine.loads == []
        assert registry.get("a") is None
        await admin(AddAdapterRequest(name="a", path=path))  # the disk has room again: the same order goes through
        record = registry.get("a")
        assert "a" in core.adapters and record.path == path and record.rank == 8 and record.content_hash

    run(tmp_path, scenario)


def test_a_failed_write_keeps_replace_remove_and_pin_as_they_were(tmp_path):
    old, new = _adapter(tmp_path / "old", b"old"), _adapter(tmp_path / "new", b"new")

    async def scenario(core, registry, admin, engine):
        await admin(AddAdapterRequest(name="a", path=old))
        before = registry.get("a")
        with writes_fail(registry.db_path):
            for msg, done in ((AddAdapterRequest(name="a", path=new, replace=True), "registered"),
                              (RemoveAdapterRequest(name="a"), "removed"),
                              (PinAdapterRequest(name="a", pinned=True), "pinned")):
                err = await refused(admin, msg)
                assert err.code == "internal" and f"was not {done}" in err.message
        entry = core.adapters.get("a")
        assert entry is not None and entry.path == old and not entry.pinned
        assert registry.get("a") == before
        await admin(RemoveAdapterRequest(name="a"))
        assert "a" not in core.adapters and registry.get("a") is None

    run(tmp_path, scenario)


def test_a_change_the_engine_refuses_leaves_the_registry_as_it_was(tmp_path):
    good, bad = _adapter(tmp_path / "good"), _adapter(tmp_path / "bad", b"bad")

    async def scenario(core, registry, admin, engine):
        err = await refused(admin, AddAdapterRequest(name="b", path=bad))
        assert err.code == "invalid_adapter" and registry.get("b") is None and "b" not in core.adapters
        await admin(AddAdapterRequest(name="a", path=good))
        before = registry.get("a")
        err = await refused(admin, AddAdapterRequest(name="a", path=bad, replace=True))
        assert err.code == "invalid_adapter"
        assert registry.get("a") == before and core.adapters.get("a").path == good
        err = await refused(admin, AddAdapterRequest(name="a", path=good))
        assert err.code == "already_exists" and registry.get("a") == before

    run(tmp_path, scenario)
