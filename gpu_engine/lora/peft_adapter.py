"""Read and validate a PEFT LoRA adapter directory against the base model.

Every file is opened through ipc/adapter_files.py (regular files only, inside the allowed
directories, sizes bounded); adapter_model.safetensors is preferred, its header checked
before any tensor is read, and a pickled adapter_model.bin is loaded only by torch's
restricted unpickler (adapter_bin.py). Which modules are adapted follows PEFT's own rules
(peft_targets.py). Modules with their own rank or alpha, and layers an adapter does not
cover, become one adapter-wide rank and scaling (zero padding, scale folded into B);
what the unmerged-LoRA executor cannot reproduce (DoRA, modules_to_save, trained biases)
is refused with an error that names it and says what to do.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes

from loraplex.contracts.head_modules import EMBED
from loraplex.errors import AdapterError, AdapterRankError, ForbiddenAdapterPathError
from loraplex.gpu_engine.lora.adapter_bin import load_adapter_bin
from loraplex.gpu_engine.lora.peft_targets import HEAD_LAYER, TargetPlan, check_tensor_table, resolve_targets
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import read_top_tensor
from loraplex.ipc.adapter_files import (
    ADAPTER_BIN,
    ADAPTER_WEIGHTS,
    MAX_WEIGHTS_BYTES,
    AdapterFileError,
    check_safetensors,
    open_adapter_file,
    read_adapter_config,
    weights_file_name,
)

_MERGE = "merge it into the base with peft's merge_and_unload() and serve the merged model"
# Settings the unmerged executor cannot reproduce: (is it set?, why, what to do).
_REFUSED = {
    "use_dora": (bool, "DoRA adapters are not served", f"{_MERGE}, or retrain without use_dora"),
    "modules_to_save": (bool, "modules_to_save (fully trained copies of base modules) is not served",
                        f"{_MERGE}, or retrain without modules_to_save"),
    "bias": (lambda v: v not in (None, "none"), "trained biases are not served",
             f"{_MERGE}, or retrain with bias='none'"),
    "lora_bias": (bool, "trained LoRA biases are not served", f"{_MERGE}, or retrain with lora_bias=False"),
    "layer_replication": (bool, "layer_replication is not served", _MERGE),
    "target_parameters": (bool, "LoRA on parameters (target_parameters) is not served", _MERGE),
    "trainable_token_indices": (bool, "trainable_token_indices is not served", _MERGE),
    "alora_invocation_tokens": (bool, "activated LoRA (alora_invocation_tokens) is not served",
                                "retrain as a plain LoRA"),
    "use_bdlora": (bool, "block-diagonal LoRA (use_bdlora) is not served", _MERGE),
    "arrow_config": (bool, "Arrow routing (arrow_config) is not served", "serve each expert adapter on its own"),
}


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return scaling(self.alpha, self.rank, self.use_rslora)


def scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's LoRA scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(slots=True)
class HostAdapter:
    """An adapter in host memory: `a[layer][module]` is [r, in], `b[layer][module]` is [out, r]
    for every layer and every module of spec.targets (zeros where the adapter does not cover it);
    for embed_tokens / lm_head, each layer's part of them (contracts/head_modules.py)."""

    name: str
    path: Path
    spec: AdapterSpec
    a: list[dict[str, torch.Tensor]]
    b: list[dict[str, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.a + self.b for t in layer.values())

    def whole_head(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """embed_tokens / lm_head joined back from every layer's part: A [r, in], B [out, r], as peft
        holds them, zero-padded past the module's own widths."""
        return torch.cat([layer[module] for layer in self.a], dim=1), torch.cat([layer[module] for layer in self.b])


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


def _read_plan(path: Path, model: ModelConfig, max_lora_rank: int, roots: tuple[str, ...],
               label: str) -> tuple[AdapterSpec, TargetPlan]:
    raw = _read_config(path, roots)
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"unsupported peft_type {raw.get('peft_type')!r}: only LORA adapters are served")
    for key, (is_set, why, todo) in _REFUSED.items():
        if key in raw and is_set(raw[key]):
            raise AdapterError(f"adapter {label}: {why} ({key}={str(raw[key])[:80]}); {todo}")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"adapter {label}: r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {label}: lora_alpha must be a finite number, got {alpha!r}")
    # fan_in_fan_out (GPT-2's Conv1D bases) only says how the base weight is laid out: PEFT stores
    # lora_A as [r, in] and lora_B as [out, r] either way, and its forward is x·Aᵀ·Bᵀ either way.
    plan = resolve_targets(raw, model, label, rank, float(alpha))
    if plan.rank > max_lora_rank:
        raise AdapterRankError(f"adapter {label}: rank {plan.rank} exceeds max_lora_rank={max_lora_rank}")
    spec = AdapterSpec(rank=plan.rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                       targets=plan.targets)
    return spec, plan


def read_adapter_spec(path: str | Path, model: ModelConfig, max_lora_rank: int,
                      roots: tuple[str, ...] = (), name: str | None = None) -> AdapterSpec:
    """The adapter's LoRA settings from its adapter_config.json; `roots`: the allowed directories
    (resolved, ipc.adapter_files.resolve_roots; empty = anywhere). `rank` is the largest of its
    modules' ranks (rank_pattern). Errors name the adapter by its registered `name` (default: its
    directory's name)."""
    path = Path(path)
    return _read_plan(path, model, max_lora_rank, roots, name or path.name)[0]


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


def _place(name: str, path: Path, model: ModelConfig, spec: AdapterSpec, plan: TargetPlan, dtype: torch.dtype,
           tensors: dict[tuple[int, str, str], torch.Tensor]) -> HostAdapter:
    """One adapter-wide rank and scaling for every (layer, module): a module of smaller rank gets
    zero rows of A and zero columns of B (they add exactly nothing), its own scaling folded into B
    (B·s_module/s_adapter), and a module the adapter does not cover in some layer gets zero A and B.
    Zero padding rather than per-layer presence: the pool, host store and backends lay an adapter
    out as the same modules at the same rank in every layer."""
    shapes = model.module_shapes()
    heads = model.head_modules()
    layers = model.num_layers
    a: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]
    b: list[dict[str, torch.Tensor]] = [{} for _ in range(layers)]

    def padded(layer: int, module: str, fan_in: int, fan_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        ta = torch.zeros(spec.rank, fan_in, dtype=dtype)  # [R, in]
        tb = torch.zeros(fan_out, spec.rank, dtype=dtype)  # [out, R]
        own = plan.modules.get((layer, module))
        if own is not None:
            ta[:own.rank, :tensors[(layer, module, "A")].shape[1]] = tensors[(layer, module, "A")]
            factor = scaling(own.alpha, own.rank, spec.use_rslora) / spec.scaling
            b_own = tensors[(layer, module, "B")]
            tb[:b_own.shape[0], :own.rank] = b_own if factor == 1.0 else b_own.to(torch.float64) * factor
        return ta, tb

    for module in spec.targets:
        head = heads.get(module)
        if head is None:
            for layer in range(layers):
                a[layer][module], b[layer][module] = padded(layer, module, *shapes[module])
            continue
        # embed_tokens / lm_head: padded to every layer's part, layer l holding part l (head_modules.py)
        ta, tb = padded(HEAD_LAYER, module, layers * head.a.per_layer, layers * head.b.per_layer)
        for layer, (part_a, part_b) in enumerate(zip(ta.chunk(layers, dim=1), tb.chunk(layers, dim=0))):
            a[layer][module], b[layer][module] = part_a.contiguous(), part_b.contiguous()
    return HostAdapter(name=name, path=path, spec=spec, a=a, b=b)


def _read_safetensors(path: Path, name: str, roots: tuple[str, ...], model: ModelConfig,
                      plan: TargetPlan) -> dict[tuple[int, str, str], torch.Tensor]:
    with open_adapter_file(path, ADAPTER_WEIGHTS, roots, max_bytes=MAX_WEIGHTS_BYTES) as f:
        table = check_safetensors(f, os.fstat(f.fileno()).st_size, f"{ADAPTER_WEIGHTS} of adapter {name}")
        where = check_tensor_table(name, ADAPTER_WEIGHTS, {k: v.shape for k, v in table.items()}, plan, model)
        get_tensor = _tensor_reader(f, name)
        return {where[key]: get_tensor(key) for key in table}


def _read_bin(path: Path, name: str, roots: tuple[str, ...], model: ModelConfig,
              plan: TargetPlan) -> dict[tuple[int, str, str], torch.Tensor]:
    loaded = load_adapter_bin(path, roots, name)
    where = check_tensor_table(name, ADAPTER_BIN, {k: tuple(v.shape) for k, v in loaded.items()}, plan, model)
    return {where[key]: t for key, t in loaded.items()}


def load_peft_adapter(name: str, path: str | Path, model: ModelConfig, *, max_lora_rank: int,
                      dtype: torch.dtype, roots: tuple[str, ...] = ()) -> HostAdapter:
    """Read, check and convert the adapter at `path`; `roots`: the allowed directories (resolved;
    empty = anywhere). AdapterError (ForbiddenAdapterPathError) names what is wrong."""
    path = Path(path)
    spec, plan = _read_plan(path, model, max_lora_rank, roots, name)
    file = weights_file_name(path)
    try:
        read = _read_bin if file == ADAPTER_BIN else _read_safetensors
        tensors = read(path, name, roots, model, plan)
    except AdapterFileError as exc:
        raise _file_error(exc) from None
    except FileNotFoundError:
        raise AdapterError(f"adapter {name}: {ADAPTER_WEIGHTS} (or {ADAPTER_BIN}) is missing") from None
    for (layer, module, kind), t in tensors.items():
        if not torch.isfinite(t).all():
            raise AdapterError(f"adapter {name}: {plan.paths[(layer, module)]}.lora_{kind} holds non-finite values")
    _check_base_copies(name, model, {m: t for (_, m, kind), t in tensors.items() if kind == "W"})
    return _place(name, path, model, spec, plan, dtype, tensors)


@functools.lru_cache(maxsize=8)
def _base_digest(model: ModelConfig, module: str, dtype: torch.dtype) -> tuple[torch.dtype, str]:
    """The base checkpoint's embedding / LM head in the coarser of `dtype` and its own: (that dtype,
    the digest of its bytes). Read from disk once per process and dtype, not once per adapter."""
    base = read_top_tensor(model.model_dir, model, "embed" if module == EMBED else "lm_head")
    coarse = min((dtype, base.dtype), key=lambda d: torch.finfo(d).bits)
    return coarse, _digest(base.to(coarse))


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy(), digest_size=16).hexdigest()


def _check_base_copies(name: str, model: ModelConfig, copies: dict[str, torch.Tensor]) -> None:
    """peft saves a targeted embedding's / LM head's own weight beside its LoRA (save_embedding_layers):
    served when it is the base model's (compared in the coarser of the two dtypes), refused when the
    adapter trained or resized it, as the unmerged LoRA path cannot carry a second copy per adapter."""
    for module, saved in copies.items():
        if model.model_dir is None:
            raise AdapterError(f"adapter {name}: it holds its own {module} weights, which can be checked against "
                               "the base model's only when the model is read from a directory")
        coarse, digest = _base_digest(model, module, saved.dtype)
        if _digest(saved.to(coarse)) != digest:
            raise AdapterError(f"adapter {name}: its saved {module} weights differ from the base model's (the "
                               f"adapter trained them, as with modules_to_save); {_MERGE}")
