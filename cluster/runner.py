"""Run the loraplex Serve application in the foreground: connect to (or start) Ray, deploy,
report where the ingress listens, block until SIGINT or SIGTERM, then delete the application
(Serve drains each replica, whose daemon drains) and shut Serve and a Ray it started down.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading

from loraplex.cluster import loopback
from loraplex.cluster.config import APP_NAME, ClusterConfig

log = logging.getLogger("loraplex.cluster")
OBJECT_STORE_BYTES = 128 << 20  # a local cluster moves only small messages


def serve_until_stopped(config: ClusterConfig, *, address: str | None, num_cpus: int, log_level: str = "info") -> int:
    local = address is None
    if local:
        loopback.prepare_local_ray()  # before Ray is first imported here (the CLI does it earlier)
    import ray
    from ray import serve

    from loraplex.cluster.app import application

    logging.basicConfig(level=log_level.upper(), format="loraplex-cluster %(levelname)s %(message)s", stream=sys.stderr)
    stop = threading.Event()
    previous: dict[int, object] = {}
    try:
        if local:  # a new cluster, every process on loopback, no dashboard, a small object store
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     object_store_memory=OBJECT_STORE_BYTES, _node_ip_address=loopback.LOOPBACK,
                     logging_level=log_level.upper(), configure_logging=False)
            loopback.confine_local_ray()
        else:
            ray.init(address=address, logging_level=log_level.upper(), configure_logging=False)
        # After ray.init: Ray's core worker installs its own fatal-signal handler, which would
        # end the process on SIGTERM before the application is torn down.
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        serve.start(http_options={"host": config.http_host, "port": config.http_port},
                    logging_config={"enable_access_log": False})
        serve.run(application(config), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"loraplex cluster: serving the OpenAI API at http://{config.http_host}:{config.http_port}/v1 "
              f"({config.replicas} replicas, router {config.router})", flush=True)
        while not stop.wait(1.0):
            pass
        print("loraplex cluster: stopping (draining the replicas)", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if ray.is_initialized():
            try:
                serve.delete(APP_NAME)
                if local:
                    serve.shutdown()
            finally:
                ray.shutdown()
