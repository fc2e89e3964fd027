"""The board: one small Serve deployment every replica publishes its latest daemon snapshot and
routing stats to (each stats period), and the ingress reads for /metrics and the replica list.
Reports older than STALE_S are dropped, so a replica Serve replaced stops counting. It also
keeps the cluster-wide adapter catalog (catalog.py) the ingress writes and every replica reads.
"""
from __future__ import annotations

import time
from typing import Any

from loraplex.cluster.catalog import Catalog
from loraplex.cluster.loopback import confine_serve_replica

STALE_S = 10.0
MAX_REPLICAS_TRACKED = 4096


class Board:
    def __init__(self) -> None:
        confine_serve_replica()
        self._reports: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
        self._catalog = Catalog()

    def register(self, name: str, root: str, key: str) -> int:
        self._catalog.register(name, root, key)
        return self._catalog.epoch

    def remove(self, name: str) -> int:
        """Tombstone `name`; its epoch. KeyError-free: removing an unknown name is the ingress's check."""
        self._catalog.remove(name)
        return self._catalog.epoch

    def catalog(self, known_epoch: int = -1) -> dict[str, Any] | None:
        """The catalog, or None when it is still at `known_epoch`."""
        return None if known_epoch == self._catalog.epoch else self._catalog.view()

    def report(self, replica: str, snapshot: dict[str, Any], routing: dict[str, Any]) -> None:
        if not isinstance(replica, str) or len(replica) > 256:
            raise ValueError("replica must be a short string")
        self._drop_stale()
        if replica not in self._reports and len(self._reports) >= MAX_REPLICAS_TRACKED:
            raise ValueError(f"the board tracks at most {MAX_REPLICAS_TRACKED} replicas")
        self._reports[replica] = (time.monotonic(), snapshot, routing)

    def snapshots(self) -> dict[str, dict[str, Any]]:
        """Each live replica's latest daemon stats snapshot."""
        self._drop_stale()
        return {r: snap for r, (_, snap, _) in self._reports.items()}

    def replicas(self) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        """Each live replica's latest (daemon stats snapshot, routing stats)."""
        self._drop_stale()
        return {r: (snap, routing) for r, (_, snap, routing) in self._reports.items()}

    def routing(self) -> dict[str, dict[str, Any]]:
        """Each live replica's latest routing stats alone (what the ingress's queue checks read often)."""
        self._drop_stale()
        return {r: routing for r, (_, _, routing) in self._reports.items()}

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for replica in [r for r, (t, _, _) in self._reports.items() if now - t > STALE_S]:
            del self._reports[replica]
