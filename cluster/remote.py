"""The client the ingress's gateway uses instead of a daemon socket: the same calls as
AsyncClient (stream, adapters, stats, ping, close), carried to the replicas by Serve deployment
handles, so the request router places each generate.

A stream that fails before its first chunk because its replica or the replica's daemon died is
sent again (another replica may take it; nothing was shown to the client yet). One that fails
after its first chunk ends with a clear `unavailable` error, never silently and never twice.
Likewise, a request still queued on a replica behind its adapter's other requests while another
replica idles is taken back and sent again, once (dLoRA's migration; placement.should_move).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from loraplex.cluster import wire
from loraplex.cluster.placement import Placement
from loraplex.cluster.resolver import AdapterResolver
from loraplex.cluster.stats import aggregate
from loraplex.ipc.client_types import AdapterInfo, GenerateResult, StreamChunk
from loraplex.ipc.errors import ErrorCode, LoraplexError

log = logging.getLogger("loraplex.cluster")
RETRIES_BEFORE_FIRST_CHUNK = 2
# A replica that reports these before its first chunk lost its daemon; another replica may serve.
_RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.ENGINE_FAILED, ErrorCode.SHUTTING_DOWN})
MOVE_CHECK_S = 0.5  # how often a request queued on a replica asks whether to move
MAX_MOVES = 1  # a request moves at most once: two replicas cannot pass it back and forth


def _unavailable(what: str, exc: BaseException) -> LoraplexError:
    return LoraplexError(ErrorCode.UNAVAILABLE, f"{what}: {type(exc).__name__}: {exc}")


async def _call(response: Any, timeout: float | None, what: str) -> Any:
    """Await a DeploymentResponse as the client library would a daemon reply."""
    try:
        return await asyncio.wait_for(response, timeout)
    except asyncio.TimeoutError:
        response.cancel()
        raise LoraplexError(ErrorCode.TIMEOUT, f"{what} timed out after {timeout:g} s") from None
    except LoraplexError:
        raise
    except Exception as exc:  # Ray's errors: the replica died, the deployment is gone...
        raise _unavailable(f"{what} failed in the cluster", exc) from None


class _Moved(Exception):
    """The request left the replica it was queued on (QueueMover said so)."""


class QueueMover:
    """Whether a request queued on a replica should move (Placement.should_move), from the replicas'
    routing stats on the board, read at most once per MOVE_CHECK_S for all the streams asking."""

    def __init__(self, board: Any, placement: Placement) -> None:
        self._board = board
        self._placement = placement
        self._routing: dict[str, Any] = {}
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def should_move(self, adapter: str | None, replica: str) -> bool:
        async with self._lock:
            if time.monotonic() - self._read_at >= MOVE_CHECK_S:
                self._read_at = time.monotonic()
                try:
                    self._routing = await _call(self._board.routing.remote(), 4 * MOVE_CHECK_S,
                                                "reading the replicas' routing stats")
                except LoraplexError as exc:  # no move without fresh stats
                    log.debug("no queue check: %s", exc)
                    self._routing = {}
        return self._placement.should_move(adapter, replica, self._routing)


class ClusterStream:
    """As AsyncStream: async iterator of StreamChunk, `.result` once it ended, `aclose()`."""

    def __init__(self, replicas: Any, payload: dict[str, Any], model_id: str, timeout: float | None,
                 resolver: AdapterResolver | None = None, mover: QueueMover | None = None) -> None:
        self._replicas = replicas
        self._resolver = resolver
        self._mover = mover
        self._replica: str | None = None  # where the request is queued (its `accepted` event)
        self._moves = 0
        self._next: asyncio.Future[Any] | None = None  # the replica's next event, awaited across checks
        self._payload = payload
        self._model_id = model_id
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        self._gen: Any = None
        self._chunks = 0
        self._retries = 0
        self._finished = False
        self.result: GenerateResult | None = None

    def _open(self) -> Any:
        options: dict[str, Any] = {"stream": True}
        if self._model_id:
            options["multiplexed_model_id"] = self._model_id
        return self._replicas.options(**options).generate.remote(self._payload)

    def __aiter__(self) -> ClusterStream:
        return self

    async def __anext__(self) -> StreamChunk:
        while True:
            if self._finished:
                raise StopAsyncIteration
            if self._gen is None:
                if self._resolver is not None and "source" not in self._payload:
                    try:
                        self._payload["source"] = await self._resolver.resolve(self._payload.get("adapter"))
                    except LoraplexError:
                        self._finished = True
                        raise
                self._gen = self._open()
            try:
                event = await self._next_event()
                if "error" in event:
                    raise wire.to_error(event["error"] or {})
            except _Moved:
                log.info("a request queued on %s behind its adapter's others moves while a replica idles",
                         self._replica)
                self._moves += 1
                self._abandon()
                continue
            except LoraplexError as exc:
                if self._chunks == 0 and exc.code in _RETRYABLE and self._retries < RETRIES_BEFORE_FIRST_CHUNK:
                    log.warning("a replica failed before the first token (%s); sending the request again", exc)
                    self._retries += 1
                    self._abandon()
                    continue
                self._finished = True
                raise
            if "accepted" in event:
                self._replica = str(event["accepted"])
                continue
            if "chunk" in event:
                self._chunks += 1
                return wire.to_chunk(event["chunk"])
            self._finished = True
            if "result" not in event:
                raise LoraplexError(ErrorCode.INTERNAL, f"a replica sent an unknown event: {sorted(event)}")
            self.result = wire.to_result(event["result"])
            raise StopAsyncIteration

    def _movable(self) -> bool:
        return self._mover is not None and self._replica is not None and self._chunks == 0 \
            and self._moves < MAX_MOVES

    async def _next_event(self) -> dict[str, Any]:
        """The replica's next event; while the request waits for its first token on a replica it may
        leave, the mover is asked every MOVE_CHECK_S (raises _Moved when it should go)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._gen.__anext__())
        try:
            while True:
                remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
                check = self._movable() and (remaining is None or remaining > MOVE_CHECK_S)
                done, _ = await asyncio.wait({self._next}, timeout=MOVE_CHECK_S if check else remaining)
                if done:
                    break
                if not check:
                    raise asyncio.TimeoutError
                if await self._mover.should_move(self._payload.get("adapter"), self._replica):  # type: ignore[union-attr]
                    raise _Moved
            event, self._next = self._next, None
            return event.result()
        except StopAsyncIteration:
            raise LoraplexError(ErrorCode.UNAVAILABLE, "the replica's stream ended without a result") from None
        except asyncio.TimeoutError:
            self._abandon()
            raise LoraplexError(ErrorCode.TIMEOUT, f"the request timed out after {self._timeout:g} s") from None
        except (LoraplexError, _Moved):
            raise
        except Exception as exc:  # the replica actor died or Serve cancelled the call
            where = "before its first token" if self._chunks == 0 else f"after {self._chunks} chunks"
            raise _unavailable(f"the replica serving the request failed {where}", exc) from None

    def _abandon(self) -> None:
        """Stop waiting on the current replica: Serve cancels its generator, which cancels on its daemon."""
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if self._gen is not None:
            self._gen.cancel()
            self._gen = None
        self._replica = None

    async def aclose(self) -> None:
        was_open, self._finished = not self._finished, True
        if was_open:
            self._abandon()


class ClusterClient:
    """The AsyncClient calls the gateway makes, against the replicas deployment and the board."""

    def __init__(self, replicas: Any, board: Any, *, multiplexed: bool, resolver: AdapterResolver | None = None,
                 name: str = "ray-serve", mover: QueueMover | None = None) -> None:
        self._replicas = replicas
        self._board = board
        self._mover = mover
        self.resolver = resolver
        self._multiplexed = multiplexed
        self.endpoint = name

    def stream(self, prompt: str | Sequence[int], adapter: str | None = None, *, timeout: float | None = None,
               **options: Any) -> ClusterStream:
        payload = wire.request(prompt, adapter, {**options, "timeout": timeout})
        model_id = adapter if (adapter and self._multiplexed) else ""
        return ClusterStream(self._replicas, payload, model_id, timeout, self.resolver, self._mover)

    async def adapters(self, *, timeout: float | None = 10.0) -> list[AdapterInfo]:
        entries = await _call(self._replicas.adapters.remote(), timeout, "listing adapters")
        infos = {e["name"]: AdapterInfo.from_entry(e) for e in entries}
        if self.resolver is not None:  # the cluster-wide ones, as registered at the ingress
            for name, location in self.resolver.registered().items():
                infos[name] = AdapterInfo(name=name, path=location, rank=infos[name].rank if name in infos else 0,
                                          target_modules=(), state="registered")
            for name in self.resolver.removed():
                infos.pop(name, None)
        return sorted(infos.values(), key=lambda a: a.name)

    async def ping(self, *, timeout: float | None = 10.0) -> float:
        return await _call(self._replicas.ping.remote(), timeout, "ping")

    async def stats(self, *, timeout: float | None = 10.0) -> dict[str, object]:
        """The replicas' latest daemon snapshots (from the board) added up; `unavailable` when
        no replica reported recently."""
        snapshots = await _call(self._board.snapshots.remote(), timeout, "reading the replicas' stats")
        total = aggregate(snapshots.values())
        if total is None:
            raise LoraplexError(ErrorCode.UNAVAILABLE, "no replica reported stats recently")
        total["replicas"] = len(snapshots)
        return total

    async def replica_snapshots(self, *, timeout: float | None = 10.0) -> dict[str, tuple[dict, dict]]:
        """Each live replica's latest (daemon stats snapshot, routing stats), from the board."""
        return await _call(self._board.replicas.remote(), timeout, "reading the replicas' stats")

    async def close(self) -> None:
        return None  # the handles belong to Serve


class ClusterAdmin:
    """The AsyncAdminClient calls the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter
    make, applied to the whole cluster through the catalog (resolver.py)."""

    def __init__(self, resolver: AdapterResolver, client: ClusterClient) -> None:
        self._resolver = resolver
        self._client = client

    async def add_adapter(self, name: str, path: str, *, replace: bool = True,
                          timeout: float | None = 120.0) -> dict[str, object]:
        return await asyncio.wait_for(self._resolver.register(name, str(path)), timeout)

    async def remove_adapter(self, name: str, *, timeout: float | None = 10.0) -> dict[str, object]:
        async def remove() -> dict[str, object]:
            if not await self._resolver.knows(name) and name not in {a.name for a in await self._client.adapters()}:
                raise LoraplexError(ErrorCode.NOT_FOUND, f"adapter {name!r} is not registered in the cluster")
            return await self._resolver.remove(name)

        return await asyncio.wait_for(remove(), timeout)

    async def close(self) -> None:
        return None
