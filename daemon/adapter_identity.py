"""What an adapter's files are: their content hash, read off the event loop with a deadline,
and trusted again while the files' sizes and mtimes stay the same. A file that may not or
cannot be read (a stand-in for a regular file, outside the allowed directories, too slow)
is a Rejected with its code. Torch-free.
"""
from __future__ import annotations

from collections.abc import Callable

from loraplex.daemon.adapter_hash import AdapterReader
from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.rejected import Rejected
from loraplex.ipc.adapter_files import AdapterFileError


class AdapterIdentity:
    def __init__(self, reader: AdapterReader) -> None:
        self.reader = reader
        # Told when an adapter's files were (re)hashed, so the registry keeps the identity (set by main).
        self.on_identified: Callable[[AdapterEntry], None] | None = None

    async def identify(self, entry: AdapterEntry) -> None:
        """Hash the entry's files; Rejected when they may not or cannot be read."""
        try:
            entry.fingerprint, entry.content_hash = await self.reader.identify(entry.path)
        except AdapterFileError as exc:
            raise Rejected(exc.code, str(exc)) from None

    async def ensure_identified(self, entry: AdapterEntry) -> None:
        """Before a lazy load: trust the recorded hash while the files' sizes and mtimes are unchanged,
        else hash them again (and record it). Rejected as identify."""
        try:
            fingerprint = await self.reader.fingerprint(entry.path)
        except AdapterFileError as exc:
            raise Rejected(exc.code, str(exc)) from None
        if entry.content_hash and fingerprint == entry.fingerprint:
            return
        await self.identify(entry)
        if self.on_identified is not None:
            self.on_identified(entry)

    async def changed(self, entry: AdapterEntry, path: str) -> bool:
        """Cheap check (sizes, mtimes, path) whether the files behind `entry` may differ now."""
        if entry.path != path:
            return True
        if entry.state == "registered":
            return False  # never loaded: nothing stale to replace, the first load reads what is there
        try:
            return await self.reader.fingerprint(path) != entry.fingerprint
        except AdapterFileError:
            return True  # replacing reports why it cannot read them
