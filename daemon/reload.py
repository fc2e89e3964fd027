"""What a running daemon takes over from outside without a restart: SIGHUP re-reads the
configuration and the adapter registry (systemd RELOADING=1), and adapters registered before
registries were scoped by base model join this model's scope when their files load on it.

Torch-free; every change goes through the serving core's admin orders, so requests in flight
are never dropped.
"""
from __future__ import annotations

import logging
import sqlite3
import time
from typing import Callable

from loraplex.daemon.adapter_hash import fingerprint_from_text
from loraplex.daemon.adapter_rules import check_adapter_path
from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.registry import AdapterRecord, AdapterRegistry
from loraplex.daemon.sdnotify import Notifier
from loraplex.daemon.serving import ServingCore

log = logging.getLogger("loraplex.daemon")


def register_startup_adapters(config: LoraplexConfig, registry: AdapterRegistry) -> None:
    """Adapters named by --adapter or the config file join the durable registry."""
    for name, path in config.adapters:
        resolved = str(check_adapter_path(path, config.server.adapter_dirs))
        registry.add(name, resolved, source="flag", replace=True)


def entry_of(record: AdapterRecord) -> AdapterEntry:
    """A registry row as the serving core's entry: not read yet, its recorded identity trusted while
    the files' sizes and mtimes stay the same."""
    return AdapterEntry(name=record.name, path=record.path, pinned=record.pinned, content_hash=record.content_hash,
                        fingerprint=fingerprint_from_text(record.fingerprint), uses=record.uses)


async def reload(core: ServingCore, registry: AdapterRegistry, notifier: Notifier,
                 reload_config: Callable[[], LoraplexConfig] | None) -> None:
    """SIGHUP: re-read the config and the registry without dropping requests (systemd RELOADING=1).
    Live-changeable: scheduler and cache policies, and the set of registered adapters."""
    notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
    try:
        if reload_config is not None:
            fresh = reload_config()
            register_startup_adapters(fresh, registry)
            core.set_policy(fresh.scheduler.policy)
            core.set_cache_policy(fresh.scheduler.cache_policy)
        await claim_unscoped(core, registry)
        records = {r.name: r for r in registry.list()}
        await _add_or_replace(core, records)
        await _remove_unlisted(core, records)
        log.info("reloaded: %d adapters", len(core.adapters.entries()))
    except Exception as exc:
        log.error("reload failed, keeping the previous configuration: %s", exc)
    finally:
        notifier.ready(f"serving {len(core.adapters.entries())} adapters (reloaded)")


async def _add_or_replace(core: ServingCore, records: dict[str, AdapterRecord]) -> None:
    for name, record in records.items():
        try:
            if name not in core.adapters:
                await core.add_adapter(name, record.path, record.pinned)
            elif await core.files_changed(name, record.path):  # new path or rewritten files
                _, changed = await core.replace_adapter(name, record.path)
                if changed:
                    log.info("reload: adapter %s has new weights", name)
        except Exception as exc:  # one bad entry must not stop the reload
            log.warning("reload: adapter %s not added or replaced: %s", name, exc)


async def _remove_unlisted(core: ServingCore, records: dict[str, AdapterRecord]) -> None:
    demo = set(core.hello.demo_adapters) if core.hello else set()
    for entry in core.adapters.entries():
        if entry.name not in records and entry.name not in demo:
            try:
                await core.remove_adapter(entry.name)
            except Exception as exc:  # in use: it stays until a later reload
                log.warning("reload: adapter %s not removed: %s", entry.name, exc)


async def claim_unscoped(core: ServingCore, registry: AdapterRegistry) -> None:
    """Adapters registered before registries were scoped by base model (or by a tool naming no model)
    join this model's scope when their files load on it; the others stay for another model's daemon.
    Runs after ready, one adapter at a time, each read bounded by server.adapter_read_timeout_s."""
    claimed = 0
    for record in registry.unscoped():
        if record.name in core.adapters:
            continue  # this model has its own adapter of that name; the unscoped one stays
        try:
            fits = await core.fits_model(record.name, record.path)
        except (EngineDied, EngineRefused) as exc:
            log.warning("unscoped adapters not checked: %s", exc)
            return
        if not fits or record.name in core.adapters:
            continue
        try:
            claimed_record = registry.claim(record.name)
        except sqlite3.Error as exc:  # a full or read-only state disk: the row stays unscoped for now
            log.warning("unscoped adapters not claimed: the registry cannot be written: %s", exc)
            return
        if claimed_record is not None:
            core.adapters.put(entry_of(claimed_record))
            if claimed_record.pinned:
                core.pin_adapter(claimed_record.name, True)
            claimed += 1
    if claimed:
        log.info("registry: %d adapters registered without a model scope load on this model; they are its own now",
                 claimed)
