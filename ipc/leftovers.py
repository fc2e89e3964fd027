"""What a daemon that died without stopping leaves behind, and removing it
(`loraplex cleanup`): socket files in its runtime directory (its public and its
children's private endpoints) and shared-memory segments named after it whose
owner process is gone.

Never touches anything of a live daemon: a directory where a socket still
accepts connections is refused, and a segment whose owner lives is kept.
Torch-free; needs no daemon.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.ipc.runtime_dir import endpoints, instance_id
from loraplex.ipc.shm import SEGMENT_PREFIX, list_segments, sweep_stale
from loraplex.ipc.socket_options import EndpointInUse, is_listening


class DaemonRunning(RuntimeError):
    """A live daemon owns the runtime directory: nothing is removed."""


@dataclass(slots=True)
class Cleanup:
    sockets: list[str] = field(default_factory=list)  # socket files removed
    segments: list[str] = field(default_factory=list)  # segments removed (their owner was dead)
    kept: list[str] = field(default_factory=list)  # segments of this instance whose owner still runs


def daemon_listening(runtime_dir: str | os.PathLike[str]) -> bool:
    """Whether a process accepts connections on one of the directory's daemon sockets."""
    for path in endpoints(runtime_dir).socket_paths:
        try:
            if is_listening(path):
                return True
        except EndpointInUse:
            return True  # cannot tell: assume a daemon rather than remove its files
    return False


def clean_runtime_dir(runtime_dir: str | os.PathLike[str]) -> Cleanup:
    """Remove the stale sockets of `runtime_dir` and the dead-owner segments of its daemon instance.
    DaemonRunning when a daemon still listens there."""
    runtime_dir = Path(runtime_dir)
    if daemon_listening(runtime_dir):
        raise DaemonRunning(f"a daemon is serving in {runtime_dir}; stop it (SIGTERM) instead of cleaning up")
    prefix = f"{SEGMENT_PREFIX}{instance_id(runtime_dir)}-"
    done = Cleanup(segments=sweep_stale(prefix))
    done.kept = list_segments(prefix)
    for path in sorted(runtime_dir.glob("*.sock")):  # public ones and the children's private endpoints
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode) and not is_listening(path):
                path.unlink()
                done.sockets.append(str(path))
        except (FileNotFoundError, EndpointInUse):
            continue
    return done
