"""The cluster-wide adapter catalog the board keeps: adapters registered at the ingress
(name -> where its files are: a source root and the adapter's key in it) and the names removed
there (tombstones, so a removed adapter is refused even where the default source still has it).
Every change bumps `epoch`, so replicas notice removals with one cheap comparison.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loraplex.contracts.names import is_valid_name

MAX_ENTRIES = 100_000
MAX_URI = 2048


def split_location(location: str) -> tuple[str, str]:
    """(source root, key) of an adapter's location: s3://b/p/NAME -> (s3://b/p, NAME), /d/NAME -> (/d, NAME)."""
    location = location.rstrip("/")
    root, _, key = location.rpartition("/")
    if not root or not is_valid_name(key) or len(location) > MAX_URI:
        raise ValueError(f"an adapter location is DIR/NAME or s3://bucket/prefix/NAME, got {location!r}")
    if root == "s3:/":
        raise ValueError(f"{location!r} names a bucket, not an adapter in it")
    return root, key


@dataclass(slots=True)
class Catalog:
    epoch: int = 0
    entries: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (root, key)
    removed: set[str] = field(default_factory=set)

    def register(self, name: str, root: str, key: str) -> None:
        if not is_valid_name(name):
            raise ValueError(f"{name!r} is not a valid adapter name")
        if name not in self.entries and len(self.entries) >= MAX_ENTRIES:
            raise ValueError(f"the catalog holds at most {MAX_ENTRIES} adapters")
        self.entries[name] = (root, key)
        self.removed.discard(name)
        self.epoch += 1

    def remove(self, name: str) -> None:
        if not is_valid_name(name):
            raise ValueError(f"{name!r} is not a valid adapter name")
        self.entries.pop(name, None)
        if len(self.removed) < MAX_ENTRIES:
            self.removed.add(name)
        self.epoch += 1

    def view(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "entries": {n: list(v) for n, v in self.entries.items()},
                "removed": sorted(self.removed)}
