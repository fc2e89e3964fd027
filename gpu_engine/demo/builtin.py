"""Which demo serves when no model is given: $LORAPLEX_DEMO, `trained` (default) or `random`.

Owns that one choice for the engine, the offline API and the CLI. The random
demo stays the fixture of the exact-parity tests, which select it here.
"""
from __future__ import annotations

import os
from pathlib import Path

from .model import DemoModel, ensure_demo_model
from .packaged import install_trained_demo, trained_demo

DEMO_ENV = "LORAPLEX_DEMO"
DEMO_KINDS = ("trained", "random")


def builtin_demo_kind() -> str:
    """$LORAPLEX_DEMO, else `trained`; anything else is an error that names the choices."""
    kind = os.environ.get(DEMO_ENV, "").strip() or "trained"
    if kind not in DEMO_KINDS:
        raise ValueError(f"{DEMO_ENV} must be one of {', '.join(DEMO_KINDS)}, got {kind!r}")
    return kind


def builtin_demo(dest: Path | None = None, *, force: bool = False, kind: str | None = None) -> DemoModel:
    """The built-in demo of `kind` (default builtin_demo_kind()).

    trained: the package copy, or a copy installed at `dest`. random: written once
    to `dest` (default: the cache dir), as `ensure_demo_model` does.
    """
    kind = kind or builtin_demo_kind()
    if kind not in DEMO_KINDS:
        raise ValueError(f"demo kind must be one of {', '.join(DEMO_KINDS)}, got {kind!r}")
    if kind == "random":
        return ensure_demo_model(dest, force=force)
    return trained_demo() if dest is None else install_trained_demo(dest, force=force)
