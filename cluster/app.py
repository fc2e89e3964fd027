"""The Serve application: the board, N replicas (each one loraplex daemon) behind the chosen
request router, and the ingress. `build_app` is the application builder for `serve run` and
Serve config files:

    serve run loraplex.cluster.app:build_app replicas=2 router=loraplex
    # or, in a Serve config file: import_path: loraplex.cluster.app:build_app, args: {replicas: 2}

`application(config)` is what `loraplex cluster serve` deploys.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from loraplex.cluster.board import Board
from loraplex.cluster.config import ClusterConfig
from loraplex.cluster.ingress import Ingress
from loraplex.cluster.replica import LoraplexReplica

ROUTER_CLASS = "loraplex.cluster.router:LoraplexRequestRouter"
HEALTH_CHECK_PERIOD_S = 2.0
GRACEFUL_SHUTDOWN_S = 30.0
QUIET = {"enable_access_log": False}  # the replicas report every stats period; one log line each is noise


def application(config: ClusterConfig) -> serve.Application:
    raw = config.to_dict()
    board = serve.deployment(Board, name="LoraplexBoard", num_replicas=1, max_ongoing_requests=10_000,
                             ray_actor_options={"num_cpus": 0}, logging_config=QUIET).bind()
    router = RequestRouterConfig(request_routing_stats_period_s=config.stats_period_s,
                                 request_routing_stats_timeout_s=max(1.0, 4 * config.stats_period_s),
                                 **({"request_router_class": ROUTER_CLASS,
                                     "request_router_kwargs": dict(config.router_options)}
                                    if config.router == "loraplex" else {}))
    replicas = serve.deployment(
        LoraplexReplica, name="LoraplexReplica", num_replicas=config.replicas,
        max_ongoing_requests=config.max_ongoing_requests, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S, request_router_config=router, logging_config=QUIET,
        ray_actor_options={"num_cpus": config.num_cpus_per_replica, "num_gpus": config.num_gpus_per_replica},
    ).bind(raw, board)
    return serve.deployment(Ingress, name="LoraplexIngress", num_replicas=1,
                            max_ongoing_requests=max(1000, config.max_ongoing_requests * config.replicas),
                            ray_actor_options={"num_cpus": 0}, logging_config=QUIET).bind(replicas, board, raw)


def build_app(args: Mapping[str, Any]) -> serve.Application:
    """Serve's application builder: `args` are ClusterConfig fields (strings from `serve run
    key=value` are parsed). http_host/http_port are Serve's, set in its config's http_options."""
    return application(ClusterConfig.from_dict(dict(args)))
