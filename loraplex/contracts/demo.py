"""Where the built-in demo lives, torch-free: which demo serves without a model
($LORAPLEX_DEMO), the trained demo's committed folder in the package and the random
demo's cache folder. gpu_engine/demo writes and serves them (it imports torch); the CLI
lists their adapters with no daemon running, and the registry scopes by the same choice.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEMO_ENV = "LORAPLEX_DEMO"
DEMO_KINDS = ("trained", "random")
ADAPTER_CONFIG = "adapter_config.json"


def builtin_demo_kind() -> str:
    """$LORAPLEX_DEMO, else `trained`; anything else is an error that names the choices."""
    kind = os.environ.get(DEMO_ENV, "").strip() or "trained"
    if kind not in DEMO_KINDS:
        raise ValueError(f"{DEMO_ENV} must be one of {', '.join(DEMO_KINDS)}, got {kind!r}")
    return kind


def default_demo_dir() -> Path:
    """$LORAPLEX_CACHE_DIR/demo-v1, else $XDG_CACHE_HOME/loraplex/demo-v1, else ~/.cache/loraplex/demo-v1."""
    if cache := os.environ.get("LORAPLEX_CACHE_DIR"):
        return Path(cache) / "demo-v1"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "loraplex" / "demo-v1"
    return Path.home() / ".cache" / "loraplex" / "demo-v1"


def trained_demo_dir() -> Path:
    """gpu_engine/demo/trained of the installed package, found without importing
    loraplex.gpu_engine.demo (which imports torch); gpu_engine/demo/packaged.py reads it."""
    spec = importlib.util.find_spec("loraplex.gpu_engine")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the loraplex.gpu_engine package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "demo" / "trained"


def demo_adapter_dirs(kind: str | None = None) -> dict[str, Path]:
    """The demo's adapter folders present on disk, by name: the trained demo's in the package;
    the random demo's once written (by the first `loraplex serve` or `loraplex demo-model`)."""
    kind = kind or builtin_demo_kind()
    root = trained_demo_dir() if kind == "trained" else default_demo_dir()
    adapters = root / "adapters"
    if not adapters.is_dir():
        return {}
    return {p.name: p for p in sorted(adapters.iterdir()) if (p / ADAPTER_CONFIG).is_file()}
