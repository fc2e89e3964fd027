"""A Serve replica: one loraplex daemon (daemon_child) and the calls the ingress and the request
router make of it: `generate` (a stream of wire events), `adapters`, `ping`, `stats`,
`record_routing_stats` (Serve polls it for the request router and it is also published on the
board for /metrics), `check_health` (a dead daemon makes Serve replace the replica).

Every request to the daemon passes through here, so the replica knows each one's adapter,
prompt length, token budget and progress without asking the daemon.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray import serve

from loraplex.cluster import wire
from loraplex.cluster.config import ClusterConfig
from loraplex.cluster.daemon_child import DaemonChild
from loraplex.cluster.disk_tier import DiskTier
from loraplex.cluster.loopback import confine_serve_replica
from loraplex.cluster.replica_adapters import ReplicaAdapters
from loraplex.cluster.stats import Flight, FlightTable, routing_stats
from loraplex.ipc.client import AsyncAdminClient, AsyncClient, LoraplexError
from loraplex.ipc.client_types import new_request_id

log = logging.getLogger("loraplex.cluster")
# Adapters Serve's multiplexing router counts as loaded on one replica (router "multiplex" only;
# the daemon's own GPU cache decides what really stays resident).
MULTIPLEX_MODELS_PER_REPLICA = 8
STATS_TIMEOUT_S = 2.0
DEFAULT_MAX_TOKENS = 64  # AsyncClient.stream's default


class LoraplexReplica:
    async def __init__(self, config: Mapping[str, Any], board: Any = None) -> None:
        confine_serve_replica()
        self.config = ClusterConfig.from_dict(config)
        self._board = board
        self._daemon = DaemonChild(config=self.config.daemon_config, args=self.config.daemon_args,
                                   env=self.config.daemon_env)
        await self._daemon.start()
        self._client = AsyncClient(runtime_dir=self._daemon.runtime_dir)
        self._admin = AsyncAdminClient(runtime_dir=self._daemon.runtime_dir)
        self._flights = FlightTable()
        self._adapters = ReplicaAdapters(self._admin, DiskTier(self._daemon.root / "adapters",
                                                               self.config.disk_tier_bytes),
                                         busy=self._flights.adapters)
        self._ranks: dict[str, int] = {}
        self._snapshot: dict[str, Any] | None = None
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self.replica_id = new_request_id("replica-")
        await self._refresh_ranks()

    async def _refresh_ranks(self) -> None:
        try:
            self._ranks = {a.name: a.rank for a in await self._client.adapters(timeout=STATS_TIMEOUT_S)}
        except LoraplexError as exc:
            log.debug("adapter list failed: %s", exc)

    @serve.multiplexed(max_num_models_per_replica=MULTIPLEX_MODELS_PER_REPLICA)
    async def _multiplexed_adapter(self, adapter: str) -> str:
        return adapter  # the daemon resolves the adapter itself; this only tells Serve where it is

    async def generate(self, payload: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The daemon's streamed generate as wire events: accepted, chunks, then one result or one error."""
        yield wire.accepted_event(self.replica_id)
        adapter = payload.get("adapter")
        options = dict(payload.get("options") or {})
        if self.config.router == "multiplex" and adapter:
            await self._multiplexed_adapter(serve.get_multiplexed_model_id() or adapter)
        if adapter and payload.get("source"):
            try:
                await self._adapters.ensure(adapter, payload["source"])
            except LoraplexError as exc:
                yield wire.error_event(exc)
                return
        request_id = options.pop("request_id", None) or new_request_id()
        flight = Flight(adapter, wire.prompt_len(payload), int(options.get("max_tokens") or DEFAULT_MAX_TOKENS))
        self._flights.flights[request_id] = flight
        if adapter and adapter not in self._ranks:
            await self._refresh_ranks()
        stream = self._client.stream(payload["prompt"], adapter, request_id=request_id, **options)
        try:
            async for chunk in stream:
                flight.started = True
                flight.generated += len(chunk.token_ids)
                yield wire.chunk_event(chunk)
            yield wire.result_event(stream.finished_result())
        except LoraplexError as exc:
            yield wire.error_event(exc)
        finally:
            self._flights.flights.pop(request_id, None)
            await stream.aclose()  # cancels on the daemon when the ingress went away mid-stream

    async def adapters(self) -> list[dict[str, Any]]:
        infos = await self._client.adapters(timeout=STATS_TIMEOUT_S)
        self._ranks = {a.name: a.rank for a in infos}
        return [{"name": a.name, "path": a.path, "rank": a.rank, "target_modules": list(a.target_modules),
                 "state": a.state, **dict(a.extra)} for a in infos]

    async def ping(self) -> float:
        return await self._client.ping(timeout=STATS_TIMEOUT_S)

    async def stats(self) -> dict[str, Any]:
        return await self._client.stats(timeout=STATS_TIMEOUT_S)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every stats period: refresh the daemon's snapshot, publish it on the
        board, and answer the routing stats."""
        try:
            self._snapshot = await self._client.stats(timeout=STATS_TIMEOUT_S)
        except LoraplexError as exc:
            log.warning("the daemon's stats did not come: %s", exc)
            self._snapshot = None
        stats = routing_stats(self._flights, self._snapshot, self._ranks, healthy=self._daemon.alive)
        proc = self._daemon.proc
        stats["daemon_pid"] = proc.pid if proc is not None else None
        if self._board is not None:
            if self._snapshot is not None:
                self._snapshot["disk_tier"] = self._adapters.tier.snapshot()
                self._board.report.remote(self.replica_id, self._snapshot, stats)
            try:
                await self._adapters.sync(await self._board.catalog.remote(self._adapters.epoch))
            except Exception as exc:  # the board is being replaced; the next period retries
                log.warning("reading the adapter catalog failed: %s", exc)
        return stats

    async def check_health(self) -> None:
        if not self._daemon.alive:
            raise RuntimeError(f"the replica's daemon exited:\n{self._daemon.log()}")

    async def __del__(self) -> None:
        await self._client.close()
        await self._admin.close()
        code = await self._daemon.stop()
        log.info("the replica's daemon stopped with %s", code)
