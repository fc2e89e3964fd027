"""The activation exchange segment between one engine and its CPU workers.

Owns the byte layout only: the owner header, the exchange header (dimensions,
so an attacher can check it maps what it expects), the control and per-site
sequence words (each 64-bit on its own cache line) and the float32 x / out
regions. Torch-free and numpy-free: the engine and the workers make their own
views of the offsets computed here.

Protocol per step (seq increases by one every step), for site = layer*4 + stage:
the engine writes the CPU rows of x into `x_region(stage)`, then
`store_and_wake(ready_word(site), seq)`; each worker waits for
`ready_word(site) >= seq`, writes its rows of `out_region(module)` for the
stage's modules and `add_and_wake(done_word(site), 1)`; the engine waits for
`done_word(site)` to reach its value before the post plus the worker count.
Regions are shared by all layers: layer l+1's x is written only after layer
l's done count was consumed.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import struct
from dataclasses import dataclass

from loraplex.contracts.head_modules import HEAD_MODULES
from loraplex.ipc.shm import HEADER_BYTES, Region, SharedSegment, ShmError, check_segment_name

# Stage s of a layer: what x holds, and which target modules read it. The one
# declaration of a module's stage: a model's module_shapes() (gpu_engine/model/config.py)
# names which of these it has; a fused module reads the same x as its parts.
STAGES: tuple[str, ...] = ("attn_in", "o_in", "mlp_in", "down_in")
MODULE_STAGE: dict[str, int] = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "qkv_proj": 0,  # x = post-input-norm hidden  [T, hidden]
    "o_proj": 1,                                           # x = attention output        [T, q_dim]
    "gate_proj": 2, "up_proj": 2, "gate_up_proj": 2,       # x = post-attention-norm     [T, hidden]
    "down_proj": 3,                                        # x = act(gate) * up, or act(up) [T, intermediate]
}
MAX_MODULES = len(MODULE_STAGE)
# Every module an adapter may target: the stages' modules, then the embedding and the LM head
# (no stage: the engine applies their LoRA itself, never the CPU workers).
ADAPTER_MODULES: tuple[str, ...] = (*MODULE_STAGE, *HEAD_MODULES)

CACHE_LINE = 64
REGION_ALIGN = 4096  # data regions start on pages: DMA-friendly, and no false sharing between regions
EXCHANGE_MAGIC = b"LPXEXC\x00\x02"
# magic, num_layers, max_tokens, modules fingerprint, spare x4
_EXCHANGE_HEADER = struct.Struct("<8s7Q")
_EXCHANGE_HEADER_AT = HEADER_BYTES
_CONTROL_AT = _EXCHANGE_HEADER_AT + CACHE_LINE
_SITES_AT = _CONTROL_AT + CACHE_LINE  # ready[0], done[0], ready[1], done[1], ... one line each


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"exchange layout {name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class ExchangeModule:
    """One target module and its widths: in the exchange, its x is its stage's region and its deltas
    [T, out_features]; in the host store (adapter_store.StoreModule), A is [rank, in_features] and
    B^T [rank, out_features] (a head module's part per layer, there only)."""

    name: str
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        if self.name not in ADAPTER_MODULES:
            raise ValueError(f"unknown target module {self.name!r}; expected one of {ADAPTER_MODULES}")
        _positive(f"{self.name} in_features", self.in_features)
        _positive(f"{self.name} out_features", self.out_features)


@dataclass(frozen=True, slots=True)
class ExchangeLayout:
    """Where everything sits in one engine's exchange segment.

    Travels in control messages as plain fields; every offset is derived from
    them, so both sides compute the same layout. `modules` is the model's
    module_shapes() in its order (exchange_layout builds it): which target
    modules have a slot, and how wide their x and delta rows are.
    """

    segment_name: str
    num_layers: int
    modules: list[ExchangeModule]
    max_tokens: int

    def __post_init__(self) -> None:
        check_segment_name(self.segment_name)
        _positive("num_layers", self.num_layers)
        _positive("max_tokens", self.max_tokens)
        if not isinstance(self.modules, (list, tuple)) or not 0 < len(self.modules) <= MAX_MODULES \
                or not all(isinstance(m, ExchangeModule) for m in self.modules):
            raise ValueError(f"exchange layout modules must list 1 to {MAX_MODULES} ExchangeModules")
        # A list, as the wire decodes it (the hash below reads it as a tuple).
        object.__setattr__(self, "modules", list(self.modules))
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"exchange layout modules repeat a name: {names}")
        if not set(names) <= set(MODULE_STAGE):
            raise ValueError(f"exchange layout modules must be stage modules {tuple(MODULE_STAGE)}, got {names}")
        if [MODULE_STAGE[n] for n in names] != sorted(MODULE_STAGE[n] for n in names):
            raise ValueError(f"exchange layout modules must be in stage order, got {names}")
        for stage, stage_name in enumerate(STAGES):
            widths = {m.in_features for m in self.modules if MODULE_STAGE[m.name] == stage}
            if len(widths) != 1:
                raise ValueError(f"exchange layout stage {stage_name} needs modules with one in_features, "
                                 f"got {sorted(widths) or 'none'}")

    def __hash__(self) -> int:  # modules is a list (the wire's type); hash it as a tuple
        return hash((self.segment_name, self.num_layers, tuple(self.modules), self.max_tokens))

    # -- modules --------------------------------------------------------------

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modules)

    def stage_modules(self, stage: int) -> tuple[str, ...]:
        """The target modules that read stage `stage`'s x, in the model's order."""
        return _stage_modules(self)[stage]

    # -- sequence words -------------------------------------------------------

    @property
    def num_sites(self) -> int:
        return self.num_layers * len(STAGES)

    def site(self, layer: int, stage: int) -> int:
        """Site index of (layer, stage): layer*4 + stage."""
        if not 0 <= layer < self.num_layers or not 0 <= stage < len(STAGES):
            raise IndexError(f"(layer {layer}, stage {stage}) outside {self.num_layers} layers x {len(STAGES)} stages")
        return layer * len(STAGES) + stage

    def _check_site(self, site: int) -> None:
        if not 0 <= site < self.num_sites:
            raise IndexError(f"site {site} outside [0, {self.num_sites})")

    def ready_word(self, site: int) -> int:
        """Word index (for loraplex._C) of ready[site]: the step seq whose x is in place."""
        self._check_site(site)
        return (_SITES_AT + 2 * site * CACHE_LINE) // 8

    def done_word(self, site: int) -> int:
        """Word index of done[site]: how many worker completions this site has seen, ever."""
        self._check_site(site)
        return (_SITES_AT + (2 * site + 1) * CACHE_LINE) // 8

    @property
    def control_word(self) -> int:
        """Word index of the abort/generation word: the engine adds 1 (add_and_wake) to
        abandon the step in flight; workers compare it with the value their job
        started under and drop the job when it moved."""
        return _CONTROL_AT // 8

    # -- data regions ---------------------------------------------------------

    def in_features(self, stage: int) -> int:
        """Width of stage `stage`'s x rows (every module of a stage reads the same x)."""
        return _shapes(self)[self.stage_modules(stage)[0]][0]

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module of this model."""
        try:
            return _shapes(self)[module]
        except KeyError:
            raise KeyError(f"module {module!r} has no exchange slot; this model's are {self.module_names}") from None

    def x_region(self, stage: int | str) -> Region:
        """[max_tokens, in_features] float32 input rows of `stage` (index or name)."""
        if isinstance(stage, str):
            if stage not in STAGES:
                raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
            stage = STAGES.index(stage)
        index = stage
        if not 0 <= index < len(STAGES):
            raise IndexError(f"stage {stage!r} outside {STAGES}")
        return _regions(self)[STAGES[index]]

    def out_region(self, module: str) -> Region:
        """[max_tokens, out_features] float32 LoRA delta rows of `module`."""
        if module not in _shapes(self):
            raise KeyError(f"module {module!r} has no exchange slot; this model's are {self.module_names}")
        return _regions(self)[module]

    def regions(self) -> dict[str, Region]:
        """Every data region by name (stage names, then module names)."""
        return dict(_regions(self))

    @property
    def words_end(self) -> int:
        """First byte after the last sequence word's cache line."""
        return _SITES_AT + 2 * self.num_sites * CACHE_LINE

    @property
    def total_bytes(self) -> int:
        """Segment size, header included (a whole number of pages)."""
        last = max(r.end for r in _regions(self).values())
        return _align(last, REGION_ALIGN)

    # -- header ---------------------------------------------------------------

    def _header_bytes(self) -> bytes:
        return _EXCHANGE_HEADER.pack(EXCHANGE_MAGIC, self.num_layers, self.max_tokens, _fingerprint(self), 0, 0, 0, 0)

    def write_header(self, buf: memoryview) -> None:
        """Stamp the dimensions after the owner header (the creator does this once)."""
        buf[_EXCHANGE_HEADER_AT:_EXCHANGE_HEADER_AT + _EXCHANGE_HEADER.size] = self._header_bytes()

    def check_header(self, buf: memoryview) -> None:
        """ShmError unless `buf` holds an exchange laid out for these dimensions."""
        if len(buf) < self.total_bytes:
            raise ShmError(errno.EINVAL, f"{self.segment_name}: {len(buf)} bytes, layout needs {self.total_bytes}")
        found = bytes(buf[_EXCHANGE_HEADER_AT:_EXCHANGE_HEADER_AT + _EXCHANGE_HEADER.size])
        if found != self._header_bytes():
            raise ShmError(errno.EINVAL, f"{self.segment_name} is not an exchange with these dimensions")

    def create_segment(self) -> SharedSegment:
        """Create the segment (the engine; zero-filled, so every word starts at 0)."""
        segment = SharedSegment.create(self.segment_name, self.total_bytes)
        self.write_header(segment.buf)
        return segment

    def attach_segment(self) -> SharedSegment:
        """Attach read-write (workers store done words) and check the dimensions."""
        segment = SharedSegment.attach(self.segment_name)
        try:
            self.check_header(segment.buf)
        except BaseException:
            segment.close()
            raise
        return segment


@functools.lru_cache(maxsize=64)
def _shapes(layout: ExchangeLayout) -> dict[str, tuple[int, int]]:
    return {m.name: (m.in_features, m.out_features) for m in layout.modules}


@functools.lru_cache(maxsize=64)
def _stage_modules(layout: ExchangeLayout) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(m.name for m in layout.modules if MODULE_STAGE[m.name] == s) for s in range(len(STAGES)))


def _fingerprint(layout: ExchangeLayout) -> int:
    """64 bits naming the module slots, so an attacher with other widths is refused."""
    text = ";".join(f"{m.name}:{m.in_features}:{m.out_features}" for m in layout.modules)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=64)
def _regions(layout: ExchangeLayout) -> dict[str, Region]:
    out: dict[str, Region] = {}
    at = _align(layout.words_end, REGION_ALIGN)
    for stage, name in enumerate(STAGES):
        out[name] = Region(at, layout.max_tokens, layout.in_features(stage))
        at = _align(out[name].end, REGION_ALIGN)
    for module in layout.modules:
        out[module.name] = Region(at, layout.max_tokens, module.out_features)
        at = _align(out[module.name].end, REGION_ALIGN)
    return out


def exchange_layout(segment_name: str, num_layers: int, module_shapes: dict[str, tuple[int, int]],
                    max_tokens: int) -> ExchangeLayout:
    """The layout of an exchange for a model with these target modules (its ModelConfig.module_shapes():
    name -> (in_features, out_features), in the model's order) and `max_tokens` CPU rows per step."""
    modules = [ExchangeModule(name, fan_in, fan_out) for name, (fan_in, fan_out) in module_shapes.items()]
    return ExchangeLayout(segment_name=segment_name, num_layers=num_layers, modules=modules, max_tokens=max_tokens)


def llama_module_shapes(hidden: int, q_dim: int, kv_dim: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """Llama's module_shapes() for these widths (tests and benchmarks without a ModelConfig)."""
    return {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}
