"""`loraplex adapters list` with no daemon running: the registry's adapters and, when the
built-in demo is the base model, the demo's own adapters (which `loraplex serve` adds at
start), each with its real rank from its adapter_config.json. Torch-free; it only reads.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple, Protocol

from loraplex.contracts.demo import builtin_demo_kind, demo_adapter_dirs
from loraplex.ipc.adapter_files import AdapterFileError, read_adapter_config


class Registered(Protocol):
    """What a registry row gives the listing (daemon.registry.AdapterRecord)."""

    name: str
    path: str
    rank: int | None


class Listed(NamedTuple):
    """One line of the listing: the same columns the daemon's listing has (tier unknown here)."""

    name: str
    rank: int | None  # None: its adapter_config.json could not be read
    state: str  # registered | built-in
    path: str

    def line(self) -> str:
        return f"{self.name}\trank={self.rank or '?'}\t{self.state}\t-\t{self.path}"


def adapter_rank(path: str | os.PathLike[str]) -> int | None:
    """The LoRA rank the engine serves the adapter at: the largest of `r` and its rank_pattern's
    ranks (modules of a lower rank are padded to it) in adapter_config.json; None when it cannot be read."""
    try:
        config = read_adapter_config(path)
    except (AdapterFileError, OSError):
        return None
    pattern = config.get("rank_pattern")
    ranks = [config.get("r"), *(pattern.values() if isinstance(pattern, dict) else ())]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        return None
    return max(ranks)


def offline_adapters(records: Iterable[Registered], demo: dict[str, Path]) -> list[Listed]:
    """The registry's rows, then the demo's adapters that no row shadows (the daemon keeps a
    registered adapter of the same name, as it does at start)."""
    rows = [Listed(r.name, r.rank or adapter_rank(r.path), "registered", r.path) for r in records]
    taken = {row.name for row in rows}
    rows += [Listed(name, adapter_rank(path), "built-in", str(path)) for name, path in demo.items()
             if name not in taken]
    return rows


def print_offline_list(records: Iterable[Registered], *, serves_demo: bool, runtime_dir: Path) -> None:
    """The listing on stdout; on stderr first, that no daemon runs and what is shown instead."""
    demo: dict[str, Path] = {}
    missing = ""
    if serves_demo:
        try:
            kind = builtin_demo_kind()
            demo = demo_adapter_dirs(kind)
        except (ValueError, OSError) as exc:  # a bad $LORAPLEX_DEMO, an unreadable package folder
            missing = f" (the built-in demo's cannot be listed: {exc})"
        else:
            if not demo:
                missing = f" (the {kind} demo's are written by the first `loraplex serve`)"
    shown = "the registry's adapters" + (" and the built-in demo's, which `loraplex serve` adds at start"
                                         if serves_demo else "")
    print(f"no loraplex daemon is running in {runtime_dir}: {shown}{missing}; states and tiers show while "
          "a daemon runs", file=sys.stderr)
    for row in offline_adapters(records, demo):
        print(row.line())
