"""Requests that wait for their adapter before any engine sees them: its weights are being
replaced, or its files are still on disk while the host store loads them. They are released
to an engine, or failed, together. Torch-free.
"""
from __future__ import annotations

from collections.abc import Callable

from loraplex.daemon.request_table import RequestTable
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.ipc.errors import ErrorCode


class HeldRequests:
    def __init__(self, requests: RequestTable, place: Callable[[SeqRequest], object]) -> None:
        self.requests = requests
        self._place = place  # hands a request to an engine (EngineSupervisor.place)
        self._held: dict[str, list[SeqRequest]] = {}  # adapter -> requests waiting for it

    def hold(self, adapter: str, seq: SeqRequest) -> None:
        self._held.setdefault(adapter, []).append(seq)

    def waiting(self, adapter: str) -> list[str]:
        """Keys of the requests held for `adapter`, in arrival order."""
        return [seq.request_id for seq in self._held.get(adapter, [])]

    def any_in_flight(self, adapter: str) -> bool:
        return any(seq.request_id in self.requests for seq in self._held.get(adapter, []))

    def release(self, adapter: str) -> None:
        """The adapter is servable: each held request still in flight goes to an engine."""
        for seq in self._held.pop(adapter, []):
            if seq.request_id in self.requests:
                self._place(seq)

    async def fail(self, adapter: str, code: ErrorCode, message: str) -> None:
        for seq in self._held.pop(adapter, []):
            await self.requests.fail(seq.request_id, code, message)

    def drop(self, key: str) -> None:
        """A request left (cancelled, failed, timed out): it waits for nothing any more."""
        for adapter, held in self._held.items():
            self._held[adapter] = [seq for seq in held if seq.request_id != key]
