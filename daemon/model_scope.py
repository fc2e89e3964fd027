"""Which base model an adapter registry scope belongs to.

The scope is `<model_type>-<16 hex>`: a SHA-256 of the fields of config.json
that decide whether a LoRA adapter fits (model type, layers, hidden,
intermediate and head sizes, head counts, vocabulary). It survives moving,
copying or re-downloading the model (a path would not), and two checkpoints
that share it take the same adapters without error; fine-tunes of one
architecture therefore share adapters, different architectures never do.
The built-in demo (no `model.model`) is `demo-<kind>` ($LORAPLEX_DEMO).
Torch-free; reads one bounded config.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from loraplex.contracts.demo import DEMO_ENV

# The config.json fields an adapter's fit depends on (absent ones hash as null).
ARCHITECTURE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
MAX_MODEL_CONFIG_BYTES = 4 << 20


class ModelScopeError(ValueError):
    """The model directory has no readable config.json to derive the scope from."""


def model_scope(model_dir: str | os.PathLike[str] | None) -> str:
    """The registry scope of the base model in `model_dir` (None: the built-in demo)."""
    if model_dir is None:
        # random:gemma2 -> demo-random-gemma2: each demo architecture has its own registry scope
        return f"demo-{(os.environ.get(DEMO_ENV, '').strip() or 'trained').replace(':', '-')}"
    config = _read_config(Path(model_dir).expanduser() / "config.json")
    fields = {name: config.get(name) for name in ARCHITECTURE_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    model_type = config.get("model_type")
    prefix = model_type if isinstance(model_type, str) and model_type.isidentifier() else "model"
    return f"{prefix[:32]}-{digest}"


def _read_config(path: Path) -> dict:
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MODEL_CONFIG_BYTES:
            raise ModelScopeError(f"{path} is not a regular file of at most {MAX_MODEL_CONFIG_BYTES} bytes")
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ModelScopeError(f"the model directory has no config.json ({path})") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelScopeError(f"cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelScopeError(f"{path} must hold a JSON object")
    return raw
