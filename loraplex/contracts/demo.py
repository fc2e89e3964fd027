"""Where the built-in demo lives, torch-free: which demo serves without a model
($LORAPLEX_DEMO: `trained`, `random`, or `random:<family>` for the random demo of another
served architecture), the trained demo's committed folder in the package and the random
demos' cache folders. gpu_engine/demo writes and serves them (it imports torch); the CLI
lists their adapters with no daemon running, and the registry scopes by the same choice.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEMO_ENV = "LORAPLEX_DEMO"
DEMO_KINDS = ("trained", "random")
# The architectures a random demo can be built in (gpu_engine/demo/families.py writes them).
DEMO_FAMILIES = ("llama", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "gpt2")
ADAPTER_CONFIG = "adapter_config.json"


def check_demo_kind(kind: str, source: str = DEMO_ENV) -> str:
    """`kind` when it names a demo (trained, random, random:<family>), else a ValueError naming the choices."""
    base, colon, family = kind.partition(":")
    if base not in DEMO_KINDS or (colon and (base != "random" or family not in DEMO_FAMILIES)):
        raise ValueError(f"{source} must be one of {', '.join(DEMO_KINDS)} or random:<family> with a family of "
                         f"{', '.join(DEMO_FAMILIES)}; got {kind!r}")
    return kind


def demo_family(kind: str) -> str:
    """The architecture of a random demo kind (`random` is Llama's)."""
    return kind.partition(":")[2] or "llama"


def builtin_demo_kind() -> str:
    """$LORAPLEX_DEMO, else `trained`; anything else is an error that names the choices."""
    return check_demo_kind(os.environ.get(DEMO_ENV, "").strip() or "trained")


def default_demo_dir() -> Path:
    """$LORAPLEX_CACHE_DIR/demo-v1, else $XDG_CACHE_HOME/loraplex/demo-v1, else ~/.cache/loraplex/demo-v1."""
    if cache := os.environ.get("LORAPLEX_CACHE_DIR"):
        return Path(cache) / "demo-v1"
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "loraplex" / "demo-v1"
    return Path.home() / ".cache" / "loraplex" / "demo-v1"


def random_demo_dir(family: str = "llama") -> Path:
    """The random demo's folder: default_demo_dir(), suffixed -<family> for a family other than Llama."""
    root = default_demo_dir()
    return root if family == "llama" else root.with_name(f"{root.name}-{family}")


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
    root = trained_demo_dir() if kind == "trained" else random_demo_dir(demo_family(kind))
    adapters = root / "adapters"
    if not adapters.is_dir():
        return {}
    return {p.name: p for p in sorted(adapters.iterdir()) if (p / ADAPTER_CONFIG).is_file()}
