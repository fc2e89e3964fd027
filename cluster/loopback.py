"""Keeps the local Ray cluster of `loraplex cluster serve` (no --address) on this host's loopback:
the environment Ray must see before it is first imported, the check and clean-up after ray.init,
and, in each Serve replica, the one listener Serve binds to every interface whatever the node's
address. Opens nothing itself; on a node whose address is not loopback it changes nothing.
"""
from __future__ import annotations

import ipaddress
import logging
import os
from typing import Any

log = logging.getLogger("loraplex.cluster")
LOOPBACK = "127.0.0.1"
# Ray turns a node address of 127.0.0.1 into the host's external one (so that other nodes could
# join) unless this host runs no multi-node cluster, which RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# declares on any OS; the GCS, the raylet, its agents and every worker then listen on the node
# address, 127.0.0.1. Ray reads it when first imported. Usage stats are off: their only
# reporter is the API server that confine_local_ray stops.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def prepare_local_ray() -> None:
    """Set the environment a local loopback cluster needs (inherited by every Ray process).
    Call before Ray is first imported in this process."""
    os.environ.update(LOCAL_RAY_ENV)


def confine_local_ray() -> None:
    """Right after ray.init started a local cluster: unless its node is on loopback, shut it down
    and raise RuntimeError; then stop Ray's API server, which include_dashboard=False still starts
    (ray/dashboard/dashboard.py with only its usage-stats module, and a metrics port) and which
    nothing here uses; Ray offers no public way to skip or stop it."""
    import ray

    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray cluster came up on {address}, not {LOOPBACK}: Ray was imported "
                           "before loraplex.cluster.loopback.prepare_local_ray() set its environment")
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if not hasattr(node, "kill_dashboard"):
        log.warning("could not stop Ray's API server (ray/dashboard/dashboard.py); it listens on %s only",
                    LOOPBACK)
        return
    node.kill_dashboard(check_alive=False)


def confine_serve_replica() -> None:
    """In a Serve replica on a loopback node: bind the replica's inter-deployment gRPC server,
    which Ray Serve binds to [::]:0 whatever the node's address, to the node's address instead
    (nothing off this host can reach a loopback node anyway). Call first in a deployment's
    constructor: Serve starts that server right after it. Elsewhere it does nothing."""
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:
        return
    if not ray.is_initialized():
        return  # not in a Ray worker (a unit test)
    node = ray.util.get_node_ip_address()
    if not _is_loopback(node):
        return
    add = getattr(replica, "add_port_to_grpc_server", None)
    if add is None or getattr(add, "loraplex_node", None) == node:
        return  # a Serve without that hook: the cluster test names the listener it leaves

    def add_on_node(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = f"[{node}]:{port}" if ":" in node else f"{node}:{port}"
        return add(server, address)

    add_on_node.loraplex_node = node  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_on_node


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
