"""What every child process the daemon starts from gpu_engine shares: its
command line (`--endpoint --spec --heartbeat-fd`), dying with the daemon (after
unlinking the shared memory it created) under a process name that says its
role, heartbeats, signal handling, and one DEALER socket on which a start
failure is reported as a fatal `engine_failure` before exiting.

Used by the engine (`loraplex-engine`) and the cache manager
(`loraplex-cache-manager`); each brings a `start(spec)` and a `serve(...)`.
A warm spare (loraplex/standby.py) arrives here the same way, its `--spec`
appended once the daemon handed it over on stdin.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import traceback
from typing import Callable, TypeVar

import zmq

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.contracts.settings import ConfigError
from loraplex.gpu_engine.model.config import UnsupportedModelError
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.heartbeat import HEARTBEAT_FD_FLAG, start_beating
from loraplex.ipc.protocol import EngineFailure
from loraplex.ipc.shm import unlink_owned
from loraplex.ipc.socket_options import CHILD_LINK_LIMITS
from loraplex.ipc.sockets import TypedSocket, make_dealer
from loraplex.lifetime import die_with_parent

State = TypeVar("State")
LINGER_MS = 2000  # how long closing the daemon socket may wait for a last message to go out


def run_child(role: str, what: str, argv: list[str] | None, start: Callable[[EngineSpec], State],
              serve: Callable[[State, TypedSocket, bool], None]) -> int:
    """Parse the command line, set the process up, `start(spec)`, then `serve(state, sock, demo)`
    until shut down (serve closes what start opened). Exit status 2 when start fails."""
    parser = argparse.ArgumentParser(prog=role, description=f"loraplex {what} process (started by the daemon)")
    parser.add_argument("--endpoint", required=True, help=f"the daemon's private {what} endpoint")
    parser.add_argument("--spec", required=True,
                        help="the EngineSpec as a JSON object (loraplex/contracts/engine_spec.py)")
    parser.add_argument(HEARTBEAT_FD_FLAG, type=int, default=None, help="pipe to write heartbeats to (inherited)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"{role} %(levelname)s %(message)s", stream=sys.stderr)
    log = logging.getLogger(role)
    die_with_parent(role, on_parent_death=unlink_owned)  # a SIGKILLed daemon leaves no segment of ours behind
    if args.heartbeat_fd is not None:
        start_beating(args.heartbeat_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which drains and then stops us
    ctx = zmq.Context()
    # A linger, so that a start failure sent just before exiting is not dropped with the socket
    # (the daemon then knew only "exited with status 2", not why).
    sock = make_dealer(ctx, args.endpoint, limits=dataclasses.replace(CHILD_LINK_LIMITS, linger_ms=LINGER_MS))
    try:
        try:
            spec = EngineSpec.from_json(args.spec)
            state = start(spec)
        except Exception as exc:  # report why we cannot start, then exit: restarting will not help
            # A refusal of what it was given (an unsupported model_type, an unreadable or missing
            # file) is one line; anything else is a bug, and its traceback is what its fixer needs.
            expected = isinstance(exc, (UnsupportedModelError, ConfigError, json.JSONDecodeError, OSError))
            log.error("%s failed to start: %s", what, exc if expected else traceback.format_exc())
            sock.send(EngineFailure(code=ErrorCode.ENGINE_FAILED.value, message=f"{what} failed to start: {exc}",
                                    fatal=True))
            return 2
        serve(state, sock, spec.model is None)
        return 0
    finally:
        sock.close()
        ctx.term()
