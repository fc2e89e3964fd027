"""Read and validate a PEFT LoRA adapter directory against the base model.

Safetensors only: a pickled `adapter_model.bin` is refused, never opened.
Every file is opened through ipc/adapter_files.py (regular files only, inside
the allowed directories, the header checked before any tensor is read: floating
point only, shapes against the model). Everything the unmerged-LoRA executor
cannot reproduce exactly (DoRA, modules_to_save, trained biases, per-layer rank
patterns, partial layer coverage) is refused with an error that names it.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes

from loraplex.errors import AdapterError, AdapterRankError, ForbiddenAdapterPathError
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.ipc.adapter_files import (
    ADAPTER_WEIGHTS,
    AdapterFileError,
    TensorInfo,
    check_safetensors,
    open_adapter_file,
    read_adapter_config,
    read_safetensors_header,
)

TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


@dataclass(slots=True)
class HostAdapter:
    """An adapter in host memory: `a[layer][module]` is [r, in], `b[layer][module]` is [out, r]."""

    name: str
    path: Path
    spec: AdapterSpec
    a: list[dict[str, torch.Tensor]]
    b: list[dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.a + self.b for t in layer.values())


def _file_error(exc: AdapterFileError) -> AdapterError:
    """The engine's typed error for a refused file (forbidden_path keeps its own code)."""
    return (ForbiddenAdapterPathError if exc.code == "forbidden_path" else AdapterError)(str(exc))


def _read_config(path: Path, roots: tuple[str, ...]) -> dict:
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    try:
        return read_adapter_config(path, roots)
    except AdapterFileError as exc:
        raise _file_error(exc) from None


def read_adapter_spec(path: str | Path, model: ModelConfig, max_lora_rank: int,
                      roots: tuple[str, ...] = (), name: str | None = None) -> AdapterSpec:
    """The adapter's LoRA settings from its adapter_config.json; `roots`: the allowed directories
    (resolved, ipc.adapter_files.resolve_roots; empty = anywhere). Errors name the adapter by its
    registered `name` (default: its directory's name)."""
    path = Path(path)
    label = name or path.name
    raw = _read_config(path, roots)
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"unsupported peft_type {raw.get('peft_type')!r}: only LORA adapters are served")
    refusals = {
        "use_dora": (lambda v: bool(v), "DoRA adapters are not supported"),
        "modules_to_save": (lambda v: bool(v), "modules_to_save (fully trained extra modules) is not supported"),
        "bias": (lambda v: v not in (None, "none"), "adapters with trained biases are not supported"),
        "lora_bias": (lambda v: bool(v), "adapters with trained biases are not supported"),
        "fan_in_fan_out": (lambda v: bool(v), "fan_in_fan_out is not supported for Llama linear layers"),
        "layers_to_transform": (lambda v: v not in (None, []), "layers_to_transform is not supported"),
        "rank_pattern": (lambda v: bool(v), "per-module rank_pattern is not supported"),
        "alpha_pattern": (lambda v: bool(v), "per-module alpha_pattern is not supported"),
    }
    for key, (bad, why) in refusals.items():
        if key in raw and bad(raw[key]):
            raise AdapterError(f"adapter {label}: {why} ({key}={raw[key]!r})")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"adapter {label}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise AdapterRankError(f"adapter {label}: rank {rank} exceeds max_lora_rank={max_lora_rank}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {label}: lora_alpha must be a finite number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        # A regex over full module names: the tensors in the file say which modules it matched.
        targets = sorted(_modules_in_file(path, roots))
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"adapter {label}: target_modules must be a non-empty list")
    unknown = sorted(set(targets) - set(TARGETABLE))
    if unknown:
        raise AdapterError(f"adapter {label}: unsupported target modules {unknown}; supported: {list(TARGETABLE)}")
    ordered = tuple(t for t in TARGETABLE if t in targets)
    return AdapterSpec(rank=rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)), targets=ordered)


def _modules_in_file(path: Path, roots: tuple[str, ...]) -> set[str]:
    try:
        keys = read_safetensors_header(path, roots)
    except AdapterFileError as exc:
        raise _file_error(exc) from None
    return {m.group(2) for m in map(_KEY.match, keys) if m is not None}


def _check_tensors(label: str, tensors: dict[str, TensorInfo], spec: AdapterSpec, model: ModelConfig) -> None:
    """Names and shapes from the header against the model, before any tensor is read."""
    shapes = model.module_shapes()
    for key, info in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {label}: unsupported tensor {key[:160]!r}")
        layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
        if layer >= model.num_layers or module not in spec.targets:
            raise AdapterError(f"adapter {label}: tensor {key!r} is outside target_modules or the model")
        fan_in, fan_out = shapes[module]
        want = (spec.rank, fan_in) if kind == "A" else (fan_out, spec.rank)
        if info.shape != want:
            raise AdapterError(
                f"adapter {label}: {key} has shape {info.shape}, expected {want} for this base model"
            )


def _tensor_reader(f: BinaryIO, label: str) -> Callable[[str], torch.Tensor]:
    """Read tensors of the already opened, checked file: through /proc/self/fd (the same inode,
    so a path swapped meanwhile is never opened), else from its bytes."""
    proc = f"/proc/self/fd/{f.fileno()}"
    try:
        if os.path.exists(proc):
            handle = safe_open(proc, framework="pt", device="cpu")
            return handle.get_tensor
        f.seek(0)
        loaded = load_safetensors_bytes(f.read())
        return loaded.__getitem__
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"adapter {label}: cannot read {ADAPTER_WEIGHTS}: {type(e).__name__}") from None


def load_peft_adapter(name: str, path: str | Path, model: ModelConfig, *, max_lora_rank: int,
                      dtype: torch.dtype, roots: tuple[str, ...] = ()) -> HostAdapter:
    """Read, check and convert the adapter at `path`; `roots`: the allowed directories (resolved;
    empty = anywhere). AdapterError (ForbiddenAdapterPathError) names what is wrong."""
    path = Path(path)
    spec = read_adapter_spec(path, model, max_lora_rank, roots, name=name)
    weights_file = path / ADAPTER_WEIGHTS
    if not os.path.lexists(weights_file):
        if (path / "adapter_model.bin").exists():
            raise AdapterError(f"adapter {name}: adapter_model.bin is a pickle; only safetensors are loaded")
        raise AdapterError(f"adapter {name}: adapter_model.safetensors is missing")
    a: list[dict[str, torch.Tensor]] = [{} for _ in range(model.num_layers)]
    b: list[dict[str, torch.Tensor]] = [{} for _ in range(model.num_layers)]
    try:
        with open_adapter_file(path, ADAPTER_WEIGHTS, roots) as f:
            tensors = check_safetensors(f, os.fstat(f.fileno()).st_size, f"{ADAPTER_WEIGHTS} of adapter {name}")
            _check_tensors(name, tensors, spec, model)
            get_tensor = _tensor_reader(f, name)
            for key in tensors:
                m = _KEY.match(key)
                layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
                t = get_tensor(key)
                if not torch.isfinite(t).all():
                    raise AdapterError(f"adapter {name}: {key} holds non-finite values")
                (a if kind == "A" else b)[layer][module] = t.to(dtype).contiguous()
    except AdapterFileError as exc:
        raise _file_error(exc) from None
    except FileNotFoundError:
        raise AdapterError(f"adapter {name}: adapter_model.safetensors is missing") from None
    for layer in range(model.num_layers):
        for module in spec.targets:
            if module not in a[layer] or module not in b[layer]:
                raise AdapterError(f"adapter {name}: layer {layer} {module} lora_A/lora_B missing")
    return HostAdapter(name=name, path=path, spec=spec, a=a, b=b)
