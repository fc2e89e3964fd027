"""The board: one small Serve deployment every replica publishes its latest daemon snapshot and
routing stats to (each stats period), and the ingress reads for /metrics and the replica list.
Reports older than STALE_S are dropped, so a replica Serve replaced stops counting.
"""
from __future__ import annotations

import time
from typing import Any

STALE_S = 10.0
MAX_REPLICAS_TRACKED = 4096


class Board:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}

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

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for replica in [r for r, (t, _, _) in self._reports.items() if now - t > STALE_S]:
            del self._reports[replica]
