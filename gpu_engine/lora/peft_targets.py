"""Which base modules a PEFT LoRA config adapts, by PEFT's own rules, and which tensors its file must hold.

Owns target matching as peft 0.21's check_target_module_exists does it (a list matched by
exact full path or "." + suffix, with layers_to_transform / layers_pattern; a string
re.fullmatch'ed against the full path; "all-linear"; exclude_modules), per-module ranks and
alphas (rank_pattern / alpha_pattern, as peft's get_pattern_key), and the check of a file's
tensor names and shapes against that plan. Works only from ModelConfig's layer_prefix,
module_paths, module_shapes and head_modules (embed_tokens, lm_head: layer HEAD_LAYER in a
plan), never from one architecture's names. Torch-free.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from loraplex.contracts.head_modules import EMBED
from loraplex.errors import AdapterError
from loraplex.gpu_engine.model.config import ModelConfig

MAX_PATTERN_CHARS = 512  # a target/rank regex longer than this is refused before it is compiled
MAX_NAMES = 4096  # entries of target_modules, exclude_modules, rank_pattern, alpha_pattern, layers_to_transform
_SHOWN = 160  # at most this many characters of a name in an error
# A quantified group that itself holds a quantifier ("(a+)+", "(.*)*"): backtracks exponentially.
_NESTED_QUANTIFIER = re.compile(r"\([^()]*[*+}][^()]*\)\s*[*+{]")
# A Linear's lora_A/B weight, or an Embedding's lora_embedding_A/B parameter (no ".weight")
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>[\w.-]+?)\.(?:lora_(?P<kind>[AB])(?:\.[\w-]+)?\.weight"
                       r"|lora_embedding_(?P<embedding_kind>[AB])(?:\.[\w-]+)?)$")
# peft's save_embedding_layers: the adapted embedding's / LM head's own weight, saved beside its LoRA
_BASE_COPY = re.compile(r"^(?:base_model\.model\.)?(?P<path>[\w.-]+?)\.base_layer\.weight$")
_ANY_LORA = re.compile(r"^(?:base_model\.model\.)?(?P<path>[\w.-]+?)\.lora_")

HEAD_LAYER = -1  # the "layer" of embed_tokens and lm_head in a TargetPlan and a tensor table
# Modules outside the decoder projections, by their last name segment: the engine applies no
# LoRA to them, except a model's own embed_tokens and lm_head (ModelConfig.head_modules()).
_UNSERVED = {
    "lm_head": "the output layer", "embed_out": "the output layer", "score": "the output layer",
    "embed_tokens": "the token embedding", "wte": "the token embedding", "embed_in": "the token embedding",
    "wpe": "the position embedding",
}


@dataclass(frozen=True, slots=True)
class ModuleLora:
    """One adapted module's own LoRA settings (rank_pattern / alpha_pattern applied)."""

    rank: int
    alpha: float


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """`modules[(layer, name)]`: every adapted projection (name: a key of module_shapes);
    `targets`: the names adapted in any layer, in module_shapes order; `rank`: the largest rank."""

    modules: dict[tuple[int, str], ModuleLora]
    targets: tuple[str, ...]
    rank: int
    paths: dict[tuple[int, str], str]  # (layer, name) -> full module path, for errors


def unserved_kind(path: str) -> str | None:
    """What a base module outside the decoder projections is ("the output layer", ...), if the
    engine serves no LoRA on it; None for a name it does not know (module_index's head paths are
    looked up first)."""
    last = path.rsplit(".", 1)[-1]
    if last in _UNSERVED:
        return _UNSERVED[last]
    return "a layer norm" if "norm" in last or last.startswith("ln_") else None


def refuse_unserved(label: str, paths: list[str]) -> AdapterError:
    shown = ", ".join(f"{p[:_SHOWN]} ({unserved_kind(p)})" for p in sorted(set(paths))[:8])
    return AdapterError(
        f"adapter {label}: LoRA on {shown} is not served (only the decoder layers' projections, the token "
        "embedding and the output layer are); "
        "retrain without these target_modules, or merge the adapter into the base with peft's "
        "merge_and_unload() and serve the merged model")


def module_index(model: ModelConfig) -> dict[str, tuple[int, str]]:
    """Full module path ("model.layers.3.self_attn.q_proj", "lm_head") -> (layer, engine name); the
    embedding and the LM head are at layer HEAD_LAYER."""
    inner = model.module_paths()
    index = {f"{model.layer_prefix}.{i}.{p}": (i, name) for i in range(model.num_layers) for name, p in inner.items()}
    index.update({head.path: (HEAD_LAYER, name) for name, head in model.head_modules().items()})
    return index


def _selects(name: str, path: str) -> bool:
    """Whether target_modules entry `name` selects the module at `path` (exact path or suffix)."""
    return path == name or path.endswith("." + name)


def _compile(label: str, field: str, pattern: object, template: str = "{}") -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise AdapterError(f"adapter {label}: {field} entries must be non-empty strings, got {str(pattern)[:_SHOWN]!r}")
    if len(pattern) > MAX_PATTERN_CHARS or _NESTED_QUANTIFIER.search(pattern):
        raise AdapterError(f"adapter {label}: {field} pattern {pattern[:_SHOWN]!r} is longer than "
                           f"{MAX_PATTERN_CHARS} characters or nests quantifiers (exponential matching); simplify it")
    try:
        return re.compile(template.format(pattern))
    except re.error as exc:
        raise AdapterError(f"adapter {label}: {field} pattern {pattern[:_SHOWN]!r} is not a valid regex "
                           f"({exc})") from None


def _names(label: str, field: str, value: object) -> list[str]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_NAMES or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"adapter {label}: {field} must be a string or a list of at most {MAX_NAMES} strings")
    return list(value)


class _Matcher:
    """peft's check_target_module_exists for one config (exclude_modules, target_modules,
    layers_to_transform, layers_pattern), validated and compiled once."""

    def __init__(self, raw: dict, label: str) -> None:
        targets = raw.get("target_modules")
        self.all_linear = isinstance(targets, str) and targets.lower() == "all-linear"
        self.regex = _compile(label, "target_modules", targets) if isinstance(targets, str) else None
        if self.regex is None:
            self.names = _names(label, "target_modules", targets)
            if not self.names:
                raise AdapterError(f"adapter {label}: target_modules must not be empty")
        exclude = raw.get("exclude_modules") or []
        self.exclude_regex = _compile(label, "exclude_modules", exclude) if isinstance(exclude, str) else None
        self.exclude = [] if isinstance(exclude, str) else _names(label, "exclude_modules", exclude)
        layers = raw.get("layers_to_transform")
        if isinstance(layers, list) and len(layers) == 0:
            layers = None  # peft: an empty list means every layer
        if layers is not None and not (
                (isinstance(layers, int) and not isinstance(layers, bool))
                or (isinstance(layers, list) and len(layers) <= MAX_NAMES
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in layers))):
            raise AdapterError(f"adapter {label}: layers_to_transform must be an integer or a list of integers")
        self.layers = None if layers is None else {layers} if isinstance(layers, int) else set(layers)
        pattern = raw.get("layers_pattern") or []
        pattern = [pattern] if isinstance(pattern, str) else _names(label, "layers_pattern", pattern)
        # peft takes the first numbered segment after the pattern (or after any first segment).
        self.layer_regexes = [_compile(label, "layers_pattern", p, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.") for p in pattern]
        if not self.layer_regexes:
            self.layer_regexes = [re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")]

    def __call__(self, key: str) -> bool:
        if self.exclude_regex is not None and self.exclude_regex.fullmatch(key):
            return False
        if key in self.exclude or any(key.endswith("." + e) for e in self.exclude):
            return False
        if self.all_linear:
            return True  # every linear but the output layer: all the decoder projections
        if self.regex is not None:
            return self.regex.fullmatch(key) is not None  # peft: no layer filter on a regex
        if key in self.names:
            return True  # peft: an exact full path is taken without the layer filter
        if not any(key.endswith("." + n) for n in self.names):
            return False
        if self.layers is None:
            return True
        for regex in self.layer_regexes:
            match = regex.match(key)
            if match is not None:
                return int(match.group("idx")) in self.layers
        return False


def _patterns(label: str, raw: dict, field: str, integer: bool) -> list[tuple[re.Pattern[str], float]]:
    r"""rank_pattern / alpha_pattern compiled as peft's get_pattern_key matches them: pattern p
    applies to module path k when re.match(rf"(.*\.)?({p})$", k); the first that matches wins."""
    patterns = raw.get(field) or {}
    if not isinstance(patterns, dict) or len(patterns) > MAX_NAMES:
        raise AdapterError(f"adapter {label}: {field} must be an object of at most {MAX_NAMES} entries")
    out = []
    for pattern, value in patterns.items():
        ok = (isinstance(value, int) and value > 0) if integer else (
            isinstance(value, (int, float)) and math.isfinite(value))
        if not ok or isinstance(value, bool):
            kind = "a positive integer" if integer else "a finite number"
            raise AdapterError(f"adapter {label}: {field}[{pattern[:_SHOWN]!r}] must be {kind}, got {value!r}")
        out.append((_compile(label, field, pattern, r"(.*\.)?({})$"), value))
    return out


def _first(patterns: list[tuple[re.Pattern[str], float]], key: str, default: float) -> float:
    return next((value for regex, value in patterns if regex.match(key)), default)


def resolve_targets(raw: dict, model: ModelConfig, label: str, rank: int, alpha: float) -> TargetPlan:
    """The projections `raw` (adapter_config.json) adapts in `model`, each with its own rank and alpha."""
    matches = _Matcher(raw, label)
    heads = [head.path for head in model.head_modules().values()]
    if isinstance(raw.get("target_modules"), list):
        unserved = [n for n in matches.names
                    if unserved_kind(n) is not None and not any(_selects(n, path) for path in heads)]
        if unserved:
            raise refuse_unserved(label, unserved)
    ranks = _patterns(label, raw, "rank_pattern", integer=True)
    alphas = _patterns(label, raw, "alpha_pattern", integer=False)
    modules: dict[tuple[int, str], ModuleLora] = {}
    paths: dict[tuple[int, str], str] = {}
    for path, where in module_index(model).items():
        if where[0] == HEAD_LAYER and matches.all_linear:
            continue  # peft's all-linear leaves out the output layer (and an embedding is no linear)
        if matches(path):
            modules[where] = ModuleLora(rank=int(_first(ranks, path, rank)), alpha=float(_first(alphas, path, alpha)))
            paths[where] = path
    if not modules:
        shown = str(raw.get("target_modules"))[:_SHOWN]
        raise AdapterError(f"adapter {label}: target_modules {shown} match no projection of this base model "
                           f"(modules are named like {next(iter(module_index(model)), '?')!r})")
    order = list(model.adapter_shapes())
    targets = tuple(sorted({name for _, name in modules}, key=order.index))
    return TargetPlan(modules=modules, targets=targets, rank=max(m.rank for m in modules.values()), paths=paths)


def check_tensor_table(label: str, file: str, shapes: dict[str, tuple[int, ...]], plan: TargetPlan,
                       model: ModelConfig) -> dict[str, tuple[int, str, str]]:
    """Each tensor name of the file -> (layer, engine name, "A" | "B"), its shape checked against its
    module's rank and the model, every planned module holding both; before any tensor is read. A
    targeted embedding's or LM head's own weight (peft saves it beside the LoRA) is kind "W": the
    caller checks that it is the base model's."""
    index = module_index(model)
    module_shapes = {**model.module_shapes(), **{n: (h.fan_in, h.fan_out) for n, h in model.head_modules().items()}}
    found: dict[str, tuple[int, str, str]] = {}
    seen: set[tuple[int, str, str]] = set()
    for key, shape in shapes.items():
        copy = _BASE_COPY.match(key)
        if copy is not None and index.get(copy.group("path"), (None,))[0] == HEAD_LAYER:
            where = index[copy.group("path")]
            if where not in plan.modules:
                raise AdapterError(f"adapter {label}: {file} holds {key[:_SHOWN]!r}, a copy of a module that "
                                   "target_modules does not select")
            if tuple(shape) != (model.vocab_size, model.hidden_size):
                raise AdapterError(f"adapter {label}: {file} holds its own {where[1]} weights of shape {tuple(shape)}, "
                                   f"the base model's are {(model.vocab_size, model.hidden_size)}: the adapter was "
                                   "trained with a resized vocabulary; merge it into the base with peft's "
                                   "merge_and_unload() and serve the merged model")
            found[key] = (*where, "W")
            continue
        m = _LORA_KEY.match(key)
        any_lora = m or _ANY_LORA.match(key)
        path = any_lora.group("path") if any_lora else key
        if m is None or path not in index:
            if unserved_kind(path) is not None:
                raise refuse_unserved(label, [path])
            raise AdapterError(f"adapter {label}: {file} holds tensor {key[:_SHOWN]!r}, which is not a LoRA A/B "
                               "weight of a projection of this base model")
        layer, name = index[path]
        kind = m.group("kind") or m.group("embedding_kind")
        if (m.group("embedding_kind") is not None) != (name == EMBED):
            raise AdapterError(f"adapter {label}: {file} holds tensor {key[:_SHOWN]!r}, which is not how peft names "
                               f"the LoRA of {path} (lora_embedding_A/B on an embedding, lora_A/B elsewhere)")
        if (layer, name) not in plan.modules:
            raise AdapterError(f"adapter {label}: {file} holds tensor {key[:_SHOWN]!r} for {path}, which "
                               "target_modules (with layers_to_transform, exclude_modules) does not select")
        if (layer, name, kind) in seen:
            raise AdapterError(f"adapter {label}: {file} holds two lora_{kind} tensors for {path}")
        seen.add((layer, name, kind))
        r = plan.modules[(layer, name)].rank
        fan_in, fan_out = module_shapes[name]
        want = (r, fan_in) if kind == "A" else (fan_out, r)
        if tuple(shape) != want:
            raise AdapterError(f"adapter {label}: {key[:_SHOWN]} has shape {tuple(shape)}, expected {want} "
                               "for this base model and the adapter's rank")
        found[key] = (layer, name, kind)
    missing = [f"{plan.paths[(layer, name)]}.lora_{kind}" for (layer, name) in plan.modules for kind in "AB"
               if (layer, name, kind) not in seen]
    if missing:
        raise AdapterError(f"adapter {label}: target_modules select {len(missing)} LoRA weights that {file} does "
                           f"not hold, e.g. {', '.join(missing[:3])}")
    return found
