"""A replica's local disk tier of fetched adapters: content-addressed directories (ROOT/<digest>/)
kept up to a byte budget, least recently used evicted first, never one still in use. A fetch
lands in a temporary directory and is renamed into place, so a reader never sees half an adapter.
Blocking (file I/O): the replica calls it in a thread.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

DEFAULT_CAPACITY_BYTES = 8 << 30


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


class DiskTier:
    def __init__(self, root: Path, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, least recent first
        self._lock = threading.Lock()
        self.fetches = self.hits = self.evictions = 0

    @property
    def used(self) -> int:
        return sum(self._entries.values())

    def path(self, digest: str) -> Path:
        return self.root / digest

    def get(self, digest: str, fetch: Callable[[Path], str], in_use: Callable[[str], bool] = lambda _: False,
            ) -> tuple[Path, str, list[str]]:
        """(directory, digest, evicted digests) of the adapter whose content is `digest`, calling
        `fetch(tmpdir) -> digest` when it is not here. The returned digest is what was fetched
        (the source may have moved on since `digest` was read); `in_use(digest)` keeps an entry."""
        with self._lock:
            if digest in self._entries:
                self._entries.move_to_end(digest)
                self.hits += 1
                return self.path(digest), digest, []
        tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=self.root))
        try:
            got = fetch(tmp)
            size = _size(tmp)
            with self._lock:
                self.fetches += 1
                target = self.path(got)
                if got in self._entries:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    shutil.rmtree(target, ignore_errors=True)
                    tmp.rename(target)
                    self._entries[got] = size
                self._entries.move_to_end(got)
                evicted = self._evict(keep=got, in_use=in_use)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in evicted:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return target, got, evicted

    def _evict(self, keep: str, in_use: Callable[[str], bool]) -> list[str]:
        evicted = []
        for digest in list(self._entries):
            if self.used <= self.capacity:
                break
            if digest == keep or in_use(digest):
                continue
            del self._entries[digest]
            evicted.append(digest)
            self.evictions += 1
        return evicted

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"adapters": len(self._entries), "used_bytes": self.used, "capacity_bytes": self.capacity,
                    "fetches": self.fetches, "hits": self.hits, "evictions": self.evictions}
