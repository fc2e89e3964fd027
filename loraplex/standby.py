"""A warm spare child process (`python -m loraplex.standby MODULE --standby ...`):
it does the child's expensive imports (torch, the engine modules) ahead of need,
says so with one byte on its heartbeat pipe, then waits on stdin for one line,
the JSON spec, and becomes that child (`MODULE.main(argv + ["--spec", line])`).
EOF on stdin: it was not needed; exit 0.

It never touches a device before its spec arrives (importing torch does not
create a CUDA context), creates no shared memory and opens no socket, so the
daemon may SIGKILL it at any time. It dies with the daemon (PDEATHSIG) and is
named `loraplex-spare` until it becomes its role. Only the importing thread is
niced: Linux nice values are per thread, and an unprivileged process can never
undo its own nice, so the serving main thread must stay at the daemon's priority.
Stdlib only until the import thread runs: this module's own import stays cheap.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from loraplex.lifetime import die_with_parent

STANDBY_FLAG = "--standby"
SPARE_NAME = "loraplex-spare"
IMPORT_NICE = 10


def _warm(module: str, loaded: list) -> None:
    try:
        os.nice(IMPORT_NICE)  # this thread only: see the module docstring
    except OSError:
        pass
    loaded.append(importlib.import_module(module))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != STANDBY_FLAG:
        print(f"usage: python -m loraplex.standby MODULE {STANDBY_FLAG} CHILD-ARGS... (started by the daemon)",
              file=sys.stderr)
        return 2
    module, child_args = argv[0], argv[2:]
    die_with_parent(SPARE_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us
    if os.getppid() == 1:
        return 0  # the daemon died before PDEATHSIG was armed
    loaded: list = []
    warm = threading.Thread(target=_warm, args=(module, loaded), name="standby-import", daemon=True)
    warm.start()
    warm.join()
    if not loaded:
        return 2  # the import failed (traceback on stderr): the daemon falls back to a cold start
    from loraplex.ipc.heartbeat import HEARTBEAT_FD_FLAG

    if HEARTBEAT_FD_FLAG in child_args:  # one byte: warm now (the daemon's `spare_ready`)
        os.write(int(child_args[child_args.index(HEARTBEAT_FD_FLAG) + 1]), b"+")
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # retired unused
    sys.stdin.close()
    return loaded[0].main([*child_args, "--spec", line.strip()])


if __name__ == "__main__":
    raise SystemExit(main())
