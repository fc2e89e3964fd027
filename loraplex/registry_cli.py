"""`loraplex registry check | repair`: the operator's way back from a damaged adapter registry
(the daemon refuses to start on one and names these commands). check reads the file and lists
what is wrong; repair, refused while a daemon holds the state directory, keeps the old file as a
timestamped backup and writes the entries that are still valid. Light: no torch, no zmq.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "loraplex registry"


def configure(parser: argparse.ArgumentParser) -> None:
    _state_dir_arg(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="list what is wrong with the registry file (exit status 1 when anything is)")
    repair = sub.add_parser("repair", help="keep a timestamped backup of the registry file and rewrite it with the "
                                           "entries that are still valid (refused while a daemon uses the state "
                                           "directory)")
    for action in (check, repair):  # given before or after the action alike
        _state_dir_arg(action)


def _state_dir_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS,
                        help="the daemon's state directory (default: server.state_dir from $LORAPLEX_CONFIG, "
                             "else $LORAPLEX_STATE_DIR, $XDG_STATE_HOME/loraplex or ~/.local/state/loraplex)")


def run(args: argparse.Namespace) -> int:
    from loraplex.daemon.config import ConfigError
    from loraplex.daemon.config_load import load_config
    from loraplex.daemon.registry_check import check_registry

    try:
        state_dir = getattr(args, "state_dir", None) or load_config(None).server.resolved_state_dir
    except (ConfigError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    path = state_dir / "registry.sqlite3"
    if args.action == "check":
        report = check_registry(path)
        if report.ok:
            print(f"{path}: ok ({len(report.rows)} adapters)")
            return 0
        count = len(report.problems)
        print(f"{path}: {count} problem{'' if count == 1 else 's'}")
        for line in report.problems:
            print(f"  {line}")
        if not report.newer_schema:
            print(f"`loraplex registry repair` keeps a backup of the file and the {len(report.rows)} valid entries")
        return 1
    return _repair(state_dir, path)


def _repair(state_dir: Path, path: Path) -> int:
    from loraplex.daemon.registry_check import check_registry, repair_registry
    from loraplex.daemon.state_lock import StateLock

    report = check_registry(path)
    try:
        if not report.ok:
            with StateLock.exclusive(state_dir):  # no daemon starts on the file while it is rewritten
                report = check_registry(path)  # again, under the lock
                result = repair_registry(path, report) if not report.ok else None
    except (OSError, ValueError) as exc:  # StateDirLocked names the daemon's pid
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    if report.ok:
        print(f"{path}: ok ({len(report.rows)} adapters), nothing to repair")
        return 0
    print(f"{path}: repaired; the old file is kept as {result.backup}")
    print(f"kept {result.kept} adapters, dropped {len(result.dropped)}" + (":" if result.dropped else ""))
    for line in result.dropped:
        print(f"  {line}")
    return 0
