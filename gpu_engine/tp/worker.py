"""A rank other than 0 of a tensor-parallel engine (`python -m
loraplex.gpu_engine.tp.worker`), started by rank 0 (gpu_engine/tp/group.py) as its
child: it joins the group, builds its shard of the model and pool, then runs every
order rank 0 shares (steps, adapter loads and unloads) exactly as rank 0 does
(gpu_engine/engine_orders.py), and agrees with the others on whether it succeeded.
It never talks to the daemon, samples nothing and replies nothing.

It dies with rank 0 (PDEATHSIG) and heartbeats to it over an inherited pipe, so a
stopped rank is noticed within seconds (gpu_engine/tp/group.py); a broken group (a
collective that failed or timed out) makes it exit non-zero, which rank 0 notices and
follows.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.gpu_engine.engine_orders import EngineOrders
from loraplex.gpu_engine.malloc_arenas import bound_malloc_arenas
from loraplex.gpu_engine.runtime import build_runtime, resolve_spec
from loraplex.gpu_engine.tp.group import RankLink, join, open_store
from loraplex.ipc.heartbeat import HEARTBEAT_FD_FLAG, start_beating
from loraplex.ipc.protocol import EngineFailure, EngineShutdown
from loraplex.lifetime import die_with_parent

ROLE = "loraplex-tp"


def serve(orders: EngineOrders, link: RankLink) -> None:
    """Run rank 0's orders until it shares EngineShutdown."""
    control = link.control
    while True:
        msg = control.receive()
        if isinstance(msg, EngineShutdown):
            return
        reply = orders.run(msg)
        orders.settle(msg, reply, control.failures(isinstance(reply, EngineFailure)), control.rank,
                      control.world_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=ROLE, description="loraplex tensor-parallel rank (started by rank 0)")
    parser.add_argument("--spec", required=True, help="the EngineSpec as rank 0 resolved it (JSON)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-file", required=True, help="rank 0's rendezvous store (a file in its private dir)")
    parser.add_argument("--parent-pid", type=int, required=True, help="rank 0: this rank dies with it")
    parser.add_argument("--demo", action="store_true", help="the built-in demo model: its adapters are allowed")
    parser.add_argument(HEARTBEAT_FD_FLAG, type=int, default=None, help="pipe to rank 0 to write heartbeats to")
    args = parser.parse_args(argv)
    if not 0 < args.rank < args.world_size:
        parser.error(f"--rank must be in 1..{args.world_size - 1}")
    name = f"{ROLE}{args.rank}"
    logging.basicConfig(level=logging.INFO, format=f"{name} %(levelname)s %(message)s", stream=sys.stderr)
    die_with_parent(name)
    if os.getppid() != args.parent_pid:  # rank 0 died before the death signal was armed
        return 1
    if args.heartbeat_fd is not None:
        start_beating(args.heartbeat_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops rank 0, then us
    bound_malloc_arenas()
    spec = EngineSpec.from_json(args.spec)
    link = join(args.rank, args.world_size, open_store(args.store_file, args.world_size),
                resolve_spec(spec, args.rank).device)
    runtime = build_runtime(spec, link=link)
    demo_adapters: list[str] = []
    if args.demo:
        from loraplex.gpu_engine.demo import builtin_demo

        demo_adapters = [str(path) for path in builtin_demo().adapters.values()]
    orders = EngineOrders(runtime, demo_adapters=demo_adapters)
    try:
        serve(orders, link)
    finally:
        orders.close()
        link.comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
