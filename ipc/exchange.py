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
import struct
from dataclasses import dataclass

from loraplex.ipc.shm import HEADER_BYTES, Region, SharedSegment, ShmError, check_segment_name

# Stage s of a layer: what x holds, and the target modules that read it.
STAGES: tuple[str, ...] = ("attn_in", "o_in", "mlp_in", "down_in")
STAGE_MODULES: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),  # x = post-input-norm hidden  [T, hidden]
    ("o_proj",),                     # x = attention output        [T, q_dim]
    ("gate_proj", "up_proj"),        # x = post-attention-norm     [T, hidden]
    ("down_proj",),                  # x = silu(gate) * up         [T, intermediate]
)
MODULES: tuple[str, ...] = tuple(m for mods in STAGE_MODULES for m in mods)
MODULE_STAGE: dict[str, int] = {m: s for s, mods in enumerate(STAGE_MODULES) for m in mods}

CACHE_LINE = 64
REGION_ALIGN = 4096  # data regions start on pages: DMA-friendly, and no false sharing between regions
EXCHANGE_MAGIC = b"LPXEXC\x00\x01"
# magic, num_layers, hidden, q_dim, kv_dim, intermediate, max_tokens, spare
_EXCHANGE_HEADER = struct.Struct("<8s7Q")
_EXCHANGE_HEADER_AT = HEADER_BYTES
_CONTROL_AT = _EXCHANGE_HEADER_AT + CACHE_LINE
_SITES_AT = _CONTROL_AT + CACHE_LINE  # ready[0], done[0], ready[1], done[1], ... one line each


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class ExchangeLayout:
    """Where everything sits in one engine's exchange segment.

    Travels in control messages as plain fields; every offset is derived from
    them, so both sides compute the same layout.
    """

    segment_name: str
    num_layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    max_tokens: int

    def __post_init__(self) -> None:
        check_segment_name(self.segment_name)
        for field in ("num_layers", "hidden", "q_dim", "kv_dim", "intermediate", "max_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"exchange layout {field} must be a positive int, got {value!r}")

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
        return (self.hidden, self.q_dim, self.hidden, self.intermediate)[stage]

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module."""
        shapes = {
            "q_proj": (self.hidden, self.q_dim),
            "k_proj": (self.hidden, self.kv_dim),
            "v_proj": (self.hidden, self.kv_dim),
            "o_proj": (self.q_dim, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        try:
            return shapes[module]
        except KeyError:
            raise KeyError(f"unknown module {module!r}; expected one of {MODULES}") from None

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
        if module not in MODULE_STAGE:
            raise KeyError(f"unknown module {module!r}; expected one of {MODULES}")
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
        return _EXCHANGE_HEADER.pack(EXCHANGE_MAGIC, self.num_layers, self.hidden, self.q_dim, self.kv_dim,
                                     self.intermediate, self.max_tokens, 0)

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
def _regions(layout: ExchangeLayout) -> dict[str, Region]:
    out: dict[str, Region] = {}
    at = _align(layout.words_end, REGION_ALIGN)
    for stage, name in enumerate(STAGES):
        out[name] = Region(at, layout.max_tokens, layout.in_features(stage))
        at = _align(out[name].end, REGION_ALIGN)
    for module in MODULES:
        out[module] = Region(at, layout.max_tokens, layout.module_shape(module)[1])
        at = _align(out[module].end, REGION_ALIGN)
    return out


def exchange_layout(segment_name: str, num_layers: int, hidden: int, q_dim: int, kv_dim: int, intermediate: int,
                    max_tokens: int) -> ExchangeLayout:
    """The layout of an exchange for a model of these dimensions and `max_tokens` CPU rows per step."""
    return ExchangeLayout(segment_name=segment_name, num_layers=num_layers, hidden=hidden, q_dim=q_dim,
                          kv_dim=kv_dim, intermediate=intermediate, max_tokens=max_tokens)
