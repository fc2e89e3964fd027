"""`loraplex cluster serve`: start (or join) a Ray cluster, deploy the loraplex Serve
application, wait for SIGINT or SIGTERM, then tear it down (Serve drains the replicas, each
replica's daemon drains) and, for a cluster it started, stop Ray. Only argparse at import time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loraplex.gateway.config import DEFAULT_SERVED_MODEL_NAME


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster", required=True, metavar="WHAT")
    serve = sub.add_parser("serve", help="deploy N replicas (one loraplex daemon each) and an OpenAI ingress on Ray "
                                         "Serve; Ctrl-C or SIGTERM drains and tears down")
    serve.add_argument("--replicas", type=int, default=1, help="replicas, each one daemon (default 1)")
    serve.add_argument("--http-host", default="127.0.0.1", help="the ingress's address (default 127.0.0.1)")
    serve.add_argument("--http-port", type=int, default=8000, help="the ingress's port (default 8000)")
    serve.add_argument("--address", default=None,
                       help="join this Ray cluster (auto: the one running here); default: start a local one")
    serve.add_argument("--config", type=Path, default=None, help="the daemons' TOML config file")
    serve.add_argument("--daemon-arg", action="append", default=[], metavar="FLAG",
                       help="an extra `loraplex serve` flag for every daemon "
                            "(repeat; e.g. --daemon-arg=--num-pages=600)")
    serve.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="GPUs Ray gives each replica")
    serve.add_argument("--num-cpus-per-replica", type=float, default=0.0, help="CPUs Ray reserves for each replica")
    serve.add_argument("--router", default="loraplex", choices=("loraplex", "multiplex", "default"),
                       help="request router: loraplex (rank-aware + adapter affinity), multiplex (Serve's "
                            "model multiplexing) or default (Serve's power of two choices)")
    serve.add_argument("--router-slo-ms", type=float, default=None,
                       help="the loraplex router's TPT SLO per step, ms (default 36)")
    serve.add_argument("--adapter-source", default=None, metavar="URI",
                       help="where adapters named cluster-wide are resolved: a directory or s3://bucket/prefix")
    serve.add_argument("--source-check-s", type=float, default=0.0,
                       help="seconds the ingress trusts an adapter's digest before reading its source again "
                            "(default 0: every request, so a replaced adapter is never served stale)")
    serve.add_argument("--disk-tier-gb", type=float, default=8.0,
                       help="each replica's local disk tier of fetched adapters, LRU (default 8 GB)")
    serve.add_argument("--enable-adapter-admin", action="store_true",
                       help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter at the ingress, for the whole "
                            "cluster (off by default)")
    serve.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    serve.add_argument("--num-cpus", type=int, default=None,
                       help="logical CPUs of a local cluster (default: the replicas' reservations + 1)")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    from loraplex.cluster.config import ClusterConfig

    try:
        config = ClusterConfig(replicas=args.replicas, daemon_config=args.config, daemon_args=tuple(args.daemon_arg),
                               num_gpus_per_replica=args.num_gpus_per_replica,
                               num_cpus_per_replica=args.num_cpus_per_replica, router=args.router,
                               adapter_source=args.adapter_source, http_host=args.http_host,
                               http_port=args.http_port, served_model_name=args.served_model_name,
                               source_check_s=args.source_check_s, enable_adapter_admin=args.enable_adapter_admin,
                               disk_tier_bytes=int(args.disk_tier_gb * (1 << 30)),
                               router_options={} if args.router_slo_ms is None else {"slo_ms": args.router_slo_ms})
    except ValueError as exc:
        print(f"loraplex cluster serve: error: {exc}", file=sys.stderr)
        return 2
    if args.address is None:
        from loraplex.cluster.loopback import prepare_local_ray

        prepare_local_ray()  # before Ray is first imported: it reads that environment then
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        print(f"loraplex cluster serve: error: Ray Serve is not installed ({exc}); "
              "pip install 'loraplex[cluster]'", file=sys.stderr)
        return 2
    from loraplex.cluster.runner import serve_until_stopped

    num_cpus = args.num_cpus
    if num_cpus is None:
        num_cpus = int(config.replicas * config.num_cpus_per_replica) + 1
    return serve_until_stopped(config, address=args.address, num_cpus=num_cpus, log_level=args.log_level)
