"""LoRA on the model's two non-layer modules, the token embedding and the LM head, laid out
as the pool lays out everything else: per layer.

The pool is `[num_layers, pages, page_elems]` and one page id reserves the same slot in every
layer, so a module outside the layers would waste num_layers - 1 copies of its slot. Instead,
each row of such a module is cut into num_layers equal parts, layer l holding part l: the
module's vocab-wide side (lm_head's B^T, embed_tokens' A) costs what it weighs, and its
hidden-wide side the same. A part wider than the widest projection row is cut once more
into `pieces` rows, so the page geometry stays that of the projections.

Per layer, a head module then looks like any projection: A [r, in_per_layer] and
B [out_per_layer, r] (the host store, the layer-group loads and the copies need nothing
else); only the forward reassembles the whole rows. PEFT's shapes: lm_head A [r, hidden],
B [vocab, r]; embed_tokens lora_embedding_A [r, vocab], lora_embedding_B [hidden, r], so the
embedding's "in" is the vocabulary (its input is a one-hot token).

Torch-free: the daemon, the host store, the tensor-parallel plan and the engine agree on it.
"""
from __future__ import annotations

from dataclasses import dataclass

EMBED = "embed_tokens"
LM_HEAD = "lm_head"
HEAD_MODULES = (EMBED, LM_HEAD)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class SpreadRows:
    """One side (A or B^T) of a head module: each of its rank rows, `width` wide, padded to
    num_layers * pieces * piece; layer l holds columns [l * per_layer, (l + 1) * per_layer) as
    `pieces` consecutive rows of `piece` elements."""

    width: int
    pieces: int
    piece: int

    @property
    def per_layer(self) -> int:
        return self.pieces * self.piece

    @classmethod
    def of(cls, width: int, num_layers: int, widest_row: int) -> SpreadRows:
        if width <= 0 or num_layers <= 0 or widest_row <= 0:
            raise ValueError("width, num_layers and widest_row must be positive")
        pieces = _ceil_div(width, num_layers * widest_row)
        return cls(width=width, pieces=pieces, piece=_ceil_div(width, num_layers * pieces))


@dataclass(frozen=True, slots=True)
class HeadModule:
    """A LoRA-targetable module outside the decoder layers: `path` is its full module path in
    the checkpoint (and PEFT's names); `fan_in`/`fan_out` its PEFT shapes' in and out."""

    name: str
    path: str
    fan_in: int
    fan_out: int
    a: SpreadRows
    b: SpreadRows

    @property
    def per_layer_shape(self) -> tuple[int, int]:
        """(in, out) of one layer's part, as a projection's module_shapes() entry."""
        return self.a.per_layer, self.b.per_layer

    def lora_rows(self, rank: int) -> tuple[int, int, int, int]:
        """(A rows, A row width, B^T rows, B^T row width) of one layer's part in the pool."""
        return rank * self.a.pieces, self.a.piece, rank * self.b.pieces, self.b.piece


def head_modules(*, hidden_size: int, vocab_size: int, num_layers: int, widest_row: int, embed_path: str,
                 lm_head_path: str) -> dict[str, HeadModule]:
    """Both head modules of a model; widest_row: its widest projection row (the page geometry's)."""
    def side(width: int) -> SpreadRows:
        return SpreadRows.of(width, num_layers, widest_row)

    return {
        EMBED: HeadModule(EMBED, embed_path, vocab_size, hidden_size, side(vocab_size), side(hidden_size)),
        LM_HEAD: HeadModule(LM_HEAD, lm_head_path, hidden_size, vocab_size, side(hidden_size), side(vocab_size)),
    }
