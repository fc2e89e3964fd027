"""The daemon's view of registered adapters: registry records joined with what
the engine reported when it loaded each one (rank, targets, pages needed).

Torch-free. The registry (SQLite) is the durable list; this table is rebuilt
from it whenever an engine starts, so a restarted engine gets every adapter.
"""
from __future__ import annotations

from dataclasses import dataclass

from loraplex.ipc.protocol import CacheStoreFull, EngineAdapterLoaded


@dataclass(slots=True)
class AdapterEntry:
    name: str
    path: str
    state: str = "registered"  # registered (not read yet: validated on first use) -> ready | error
    rank: int = 0
    target_modules: tuple[str, ...] = ()
    num_pages: int = 0
    nbytes: int = 0
    pinned: bool = False
    error: str | None = None
    requests: int = 0
    scaling: float = 1.0
    store_entry: object | None = None  # ipc.adapter_store.StoreEntry while it sits in a host store
    content_hash: str = ""  # SHA-256 of its files when loaded (daemon.adapter_hash)
    fingerprint: tuple = ()  # file sizes and mtimes when hashed: a cheap "did the files change?"
    replacing: bool = False  # new weights are being swapped in; new requests wait
    store_bytes: int = 0  # the extent it takes in the host store, once the cache manager said (0: unknown)
    uses: int = 0  # requests served with it in past runs (the registry's count): warm-up order

    def loaded(self, info: EngineAdapterLoaded | CacheStoreFull) -> None:
        """Valid files; what they hold. A cache_store_full reply validates too (kept on disk)."""
        self.state = "ready"
        self.rank = info.rank
        self.target_modules = tuple(info.target_modules)
        self.num_pages = info.num_pages
        self.nbytes = info.nbytes
        self.scaling = info.scaling
        self.store_entry = getattr(info, "store_entry", None)
        self.error = None

    def failed(self, message: str) -> None:
        self.state = "error"
        self.error = message

    def to_wire(self, resident: bool, refs: int, tier: str | None = None) -> dict[str, object]:
        """resident: in a GPU pool; tier: the fastest tier holding it (gpu, host or disk; None unknown)."""
        entry: dict[str, object] = {
            "name": self.name, "path": self.path, "rank": self.rank, "target_modules": list(self.target_modules),
            "state": self.state, "pinned": self.pinned, "pages": self.num_pages, "bytes": self.nbytes,
            "resident": resident, "refs": refs, "requests": self.requests,
            "content_hash": self.content_hash[:16],
        }
        if tier is not None:
            entry["tier"] = tier
        if self.error:
            entry["error"] = self.error[:500]
        return entry


class AdapterTable:
    def __init__(self) -> None:
        self._entries: dict[str, AdapterEntry] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def put(self, entry: AdapterEntry) -> None:
        self._entries[entry.name] = entry

    def pop(self, name: str) -> AdapterEntry | None:
        return self._entries.pop(name, None)

    def entries(self) -> list[AdapterEntry]:
        """Sorted by name."""
        return [self._entries[n] for n in sorted(self._entries)]

    def values(self) -> list[AdapterEntry]:
        """In no particular order (no sort: stats read it four times a second)."""
        return list(self._entries.values())

    def ready(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.state == "ready"

    def pages(self, name: str) -> int:
        return self._entries[name].num_pages

    def rank_of(self, name: str) -> int:
        """The adapter's rank; 0 when it is unknown (or gone)."""
        entry = self._entries.get(name)
        return entry.rank if entry is not None else 0
