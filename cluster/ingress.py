"""The cluster's HTTP ingress: Serve's proxy hands each request here, and it is answered by the
gateway's own aiohttp application (loraplex.gateway: the same parsing, errors, SSE streaming,
/v1/models, /health and /metrics), served on a loopback port inside this replica with a
ClusterClient in place of the daemon socket. The request and the response are passed through
unchanged, the body streamed as it comes, so a client that goes away cancels its generation.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from loraplex.cluster.config import ClusterConfig
from loraplex.cluster.loopback import confine_serve_replica
from loraplex.cluster.placement import SPREAD_QUEUE, Placement
from loraplex.cluster.remote import ClusterAdmin, ClusterClient, QueueMover
from loraplex.cluster.resolver import AdapterResolver
from loraplex.cluster.routes import add_routes
from loraplex.gateway.app import build_app, listen
from loraplex.gateway.config import GatewayConfig

log = logging.getLogger("loraplex.cluster")
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the server recomputes are not passed through.
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host",
                  "content-length", "proxy-connection"})


class Ingress:
    async def __init__(self, replicas: Any, board: Any, config: Mapping[str, Any]) -> None:
        confine_serve_replica()
        cluster = ClusterConfig.from_dict(config)
        gateway = GatewayConfig(host="127.0.0.1", port=0, served_model_name=cluster.served_model_name,
                                enable_adapter_admin=cluster.enable_adapter_admin)
        resolver = AdapterResolver(board, cluster.adapter_source, check_s=cluster.source_check_s)
        # dLoRA's moves of queued requests belong to the loraplex router, which spreads a hot adapter too.
        mover = (QueueMover(board,
                            Placement(spread_queue=int(cluster.router_options.get("spread_queue", SPREAD_QUEUE))))
                 if cluster.router == "loraplex" else None)
        self.client = ClusterClient(replicas, board, multiplexed=cluster.multiplexed, resolver=resolver, mover=mover)
        app = build_app(gateway, client=self.client, admin=ClusterAdmin(resolver, self.client))  # type: ignore[arg-type]
        add_routes(app, self.client)
        self._runner, host, port = await listen(app, "127.0.0.1", 0)
        self._base = f"http://{host}:{port}"
        # No total timeout: a stream lasts as long as its generation; the gateway bounds requests.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              auto_decompress=False)
        log.info("the cluster ingress answers through the gateway at %s", self._base)

    async def __call__(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        upstream = await self._session.request(request.method, self._base + request.url.path,
                                               params=list(request.query_params.multi_items()), headers=headers,
                                               data=await request.body(), allow_redirects=False)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}

        async def body() -> AsyncIterator[bytes]:
            try:
                async for data in upstream.content.iter_any():
                    yield data
            finally:
                if upstream.content.at_eof():
                    upstream.release()
                else:  # the client went away mid-body: closing the hop makes the gateway cancel the generation
                    upstream.close()

        return StreamingResponse(body(), status_code=upstream.status, headers=out_headers,
                                 media_type=upstream.headers.get("Content-Type"))

    async def __del__(self) -> None:
        await self._session.close()
        await self._runner.cleanup()
