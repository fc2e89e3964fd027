"""The ingress's routes beyond the gateway's: the replicas and what each holds
(GET /v1/cluster/replicas), and one replica's metrics in the gateway's format
(GET /metrics/replicas/{replica}: its daemon's queues, vllm:lora_requests_info...), so a
Kubernetes inference router can score replicas one by one.
"""
from __future__ import annotations

from aiohttp import web

from loraplex.cluster.remote import ClusterClient
from loraplex.gateway.app import METRICS_CONTENT_TYPE
from loraplex.gateway.config import DEFAULT_MAX_LORAS
from loraplex.gateway.daemon_metrics import DaemonStats
from loraplex.gateway.errors import ApiError
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.ipc.errors import LoraplexError

TIMEOUT_S = 2.0
CLUSTER = web.AppKey("loraplex_cluster_client", ClusterClient)


def add_routes(app: web.Application, client: ClusterClient) -> None:
    app[CLUSTER] = client
    app.router.add_get("/v1/cluster/replicas", replicas)
    app.router.add_get("/metrics/replicas/{replica}", replica_metrics)


async def replicas(request: web.Request) -> web.Response:
    client = request.app[CLUSTER]
    try:
        snapshots = await client.replica_snapshots(timeout=TIMEOUT_S)
    except LoraplexError as exc:
        raise ApiError(503, str(exc), code="unavailable") from None
    rows = []
    for replica, (snap, routing) in sorted(snapshots.items()):
        rows.append({"replica": replica, "daemon_pid": routing.get("daemon_pid"), "healthy": routing.get("healthy"),
                     "running": len(routing.get("running") or []), "waiting": len(routing.get("waiting") or []),
                     "gpu_adapters": routing.get("gpu") or [], "host_adapters": routing.get("host") or [],
                     "requests_by_adapter": snap.get("requests_by_adapter") or {},
                     "metrics": f"/metrics/replicas/{replica}"})
    return web.json_response({"object": "list", "data": rows})


async def replica_metrics(request: web.Request) -> web.Response:
    client, replica = request.app[CLUSTER], request.match_info["replica"]
    snapshots = await client.replica_snapshots(timeout=TIMEOUT_S)
    if replica not in snapshots:
        raise ApiError(404, f"no replica {replica!r} reported recently", code="not_found")
    snapshot = snapshots[replica][0]

    async def poll(_: float) -> dict[str, object]:
        return snapshot

    metrics = GatewayMetrics(DaemonStats(poll, timeout_s=TIMEOUT_S, cache_s=0.0), max_loras=DEFAULT_MAX_LORAS)
    return web.Response(body=await metrics.exposition(), headers={"Content-Type": METRICS_CONTENT_TYPE})
