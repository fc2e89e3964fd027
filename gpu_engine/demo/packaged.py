"""The trained demo committed with the package: a tiny Shakespeare Llama and its style adapters.

Owns where the committed files live (`trained/` next to this module, written by
`python -m loraplex.gpu_engine.demo.train --out gpu_engine/demo/trained`) and the
all-or-nothing copy of them elsewhere. Serving reads the package copy in place;
nothing here trains, downloads or writes into the package.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import MappingProxyType

from .install import ensure_installed
from .model import DemoModel
from .styles import STYLES

TRAINED_DIR = Path(__file__).parent / "trained"
TRAINED_VERSION = "loraplex-demo-trained-v1"
TRAINED_ADAPTERS: tuple[str, ...] = tuple(style.name for style in STYLES)


def _describe(root: Path) -> DemoModel:
    adapters = {name: root / "adapters" / name for name in TRAINED_ADAPTERS}
    return DemoModel(root=root, model_dir=root / "model", adapters=MappingProxyType(adapters))


def trained_demo() -> DemoModel:
    """The committed trained demo, read in place from the package."""
    if not (TRAINED_DIR / "model" / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the trained demo is missing from {TRAINED_DIR}; "
            "rebuild it with: python -m loraplex.gpu_engine.demo.train --out " + str(TRAINED_DIR)
        )
    return _describe(TRAINED_DIR)


def install_trained_demo(dest: Path, *, force: bool = False) -> DemoModel:
    """Copy the trained demo to `dest` all-or-nothing (kept if already there, unless forced)."""
    source = trained_demo()

    def copy(tmp: Path) -> None:
        shutil.copytree(source.model_dir, tmp / "model")
        for name, path in source.adapters.items():
            shutil.copytree(path, tmp / "adapters" / name)

    return _describe(ensure_installed(dest, TRAINED_VERSION, copy, force=force))
