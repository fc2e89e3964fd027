"""Read a small JSON settings file (profiles) with one error for bad JSON. Torch-free."""
from __future__ import annotations

import json
from pathlib import Path


def read_json_file(path: str | Path) -> object:
    """The parsed file; ValueError naming the file when it is not valid JSON (OSError passes)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
