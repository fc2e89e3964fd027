"""Which demo serves when no model is given: $LORAPLEX_DEMO, `trained` (default), `random`
or `random:<family>` (the random demo of another served architecture).

Builds the chosen demo for the engine, the offline API and the CLI; the choice
itself is loraplex.contracts.demo's (torch-free). The random demo stays the
fixture of the exact-parity tests, which select it here.
"""
from __future__ import annotations

from pathlib import Path

from loraplex.contracts.demo import (  # torch-free: the CLI reads them too
    DEMO_ENV,
    DEMO_KINDS,
    builtin_demo_kind,
    check_demo_kind,
    demo_family,
)

from .model import DemoModel, ensure_demo_model
from .packaged import install_trained_demo, trained_demo

__all__ = ["DEMO_ENV", "DEMO_KINDS", "builtin_demo", "builtin_demo_kind"]


def builtin_demo(dest: Path | None = None, *, force: bool = False, kind: str | None = None) -> DemoModel:
    """The built-in demo of `kind` (default builtin_demo_kind()).

    trained: the package copy, or a copy installed at `dest`. random[:family]: written once
    to `dest` (default: the cache dir), as `ensure_demo_model` does.
    """
    kind = check_demo_kind(kind, "demo kind") if kind else builtin_demo_kind()
    if kind.startswith("random"):
        return ensure_demo_model(dest, force=force, family=demo_family(kind))
    return trained_demo() if dest is None else install_trained_demo(dest, force=force)
