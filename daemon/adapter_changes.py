"""Admin changes to which adapters exist (add, replace, remove, pin), kept in step with the
registry: the registry is written first and the serving core changes after, and a change the core
then refuses puts the registry back. A write that fails (a full state disk, a read-only one)
therefore changes nothing. The daemon never serves an adapter that a restart would lose, and never
leaves a row behind for one it refused. Torch-free.
"""
from __future__ import annotations

import logging
import sqlite3
from typing import Callable, TypeVar

from loraplex.daemon.adapter_hash import fingerprint_to_text
from loraplex.daemon.adapter_rules import RegistryError
from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.registry import AdapterRecord, AdapterRegistry
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.serving import ServingCore
from loraplex.ipc.errors import ErrorCode

log = logging.getLogger("loraplex.daemon")
T = TypeVar("T")


class AdapterChanges:
    def __init__(self, core: ServingCore, registry: AdapterRegistry) -> None:
        self.core = core
        self.registry = registry

    async def add(self, name: str, path: str, *, replace: bool) -> tuple[AdapterEntry, bool]:
        """Register and serve `name` at `path` (replace: give an existing one these files). Returns
        (entry, changed). RegistryError as the registry refuses; Rejected as the core does."""
        if not replace and name in self.core.adapters:  # the built-in demo adapters live only in memory
            raise Rejected(ErrorCode.ALREADY_EXISTS, f"adapter {name!r} is already registered")
        before = self._write(name, "registered", lambda: self.registry.get(name))
        self._write(name, "registered", lambda: self.registry.add(name, path, source="admin", replace=replace))
        try:
            if replace:
                entry, changed = await self.core.replace_adapter(name, path)
            else:
                entry, changed = await self.core.add_adapter(name, path), True
        except BaseException:
            self._undo(name, before)
            raise
        self._record(entry)
        return entry, changed

    async def remove(self, name: str) -> None:
        self.core.check_removable(name)
        self._write(name, "removed", lambda: self.registry.remove(name, missing_ok=True))
        # No await since the check: nothing can have started using the adapter in between.
        await self.core.remove_adapter(name)

    def pin(self, name: str, pinned: bool) -> None:
        entry = self.core.adapters.get(name)
        if entry is None:
            raise Rejected(ErrorCode.NOT_FOUND, f"unknown adapter {name!r}")
        if self._write(name, "pinned", lambda: self.registry.get(name)) is not None:  # demo adapters: memory only
            self._write(name, "pinned", lambda: self.registry.set_pinned(name, pinned))
        entry.pinned = pinned
        self.core.pin_adapter(name, pinned)

    # ---- internals -------------------------------------------------------------------------------
    def _write(self, name: str, done: str, change: Callable[[], T]) -> T:
        """Run one registry call; a storage failure becomes a refusal that says nothing changed."""
        try:
            return change()
        except sqlite3.Error as exc:
            log.error("adapter %s not %s: the adapter registry %s cannot be written: %s", name, done,
                      self.registry.db_path, exc)
            raise Rejected(ErrorCode.INTERNAL, f"adapter {name!r} was not {done}: the adapter registry "
                                               f"{self.registry.db_path} cannot be written ({exc}); nothing "
                                               "changed") from None

    def _undo(self, name: str, before: AdapterRecord | None) -> None:
        """The core refused the change: the registry names what the core serves again."""
        try:
            if before is None:
                self.registry.remove(name, missing_ok=True)
            else:
                self.registry.restore(before)
        except sqlite3.Error as exc:
            log.error("adapter %s: the registry could not be put back after a refused change (%s); it now names "
                      "what the daemon does not serve: check it with `loraplex adapters list`", name, exc)

    def _record(self, entry: AdapterEntry) -> None:
        """What the core read of the files (rank, targets, identity): a cache for the next start. The row
        is already right without it, so a failed write is only logged."""
        try:
            self.registry.add(entry.name, entry.path, rank=entry.rank or None, target_modules=entry.target_modules,
                              source="admin", replace=True, content_hash=entry.content_hash,
                              fingerprint=fingerprint_to_text(entry.fingerprint))
        except (sqlite3.Error, RegistryError) as exc:
            log.warning("adapter %s: its rank and content hash were not recorded (%s); the next start reads the "
                        "files again", entry.name, exc)
