"""Tensor-parallel split of a Llama-family model over N ranks (Megatron-LM) and of
its LoRA adapters (S-LoRA §6.1), as both sides must agree on it: which dimension
of every weight each rank holds, the per-rank page geometry and adapter layouts
(identical on every rank, so one page table serves them all), and what every
collective carries per token.

Torch-free: the daemon plans pages with it, the engine's ranks slice tensors by
it (gpu_engine/tp/partition.py), bench/tp_comm.py counts bytes with it.

The split, per decoder layer:
- q/k/v/gate/up are column-parallel: rank i holds out-features slice i of W.
  Their LoRA: A [r, in] split along r (rows, padded to a multiple of N with
  zeros), x·A_i all-gathered into x·A [tokens, r_pad], B [out, r] split along
  out like W, so rank i adds its slice of the output with no further traffic.
- o/down are row-parallel: rank i holds in-features slice i of W and returns a
  partial sum, all-reduced. Their LoRA: A split along in (x arrives split), the
  partial x·A [tokens, r] all-reduced (small), B split along out; rank i adds
  its output slice into its own partial sum before the base model's all-reduce,
  which thereby also gathers the LoRA output (no collective of its own).
- the embedding and the LM head are split along the vocabulary (padded to a
  multiple of N): lookups all-reduced, logits gathered to rank 0 for sampling.
"""
from __future__ import annotations

from dataclasses import dataclass

from loraplex.contracts.geometry import AdapterLayout, PageGeometry, pack_adapter_rows
from loraplex.contracts.head_modules import HeadModule
from loraplex.contracts.settings import ConfigError

# qkv_proj / gate_up_proj: fused q,k,v / gate,up (Phi-3), column-parallel part by part (fused_parts)
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class TensorParallelPlan:
    """How one model splits over `world_size` ranks; every rank's shard has the same shapes."""

    world_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # (name, in, out) of every projection when the model names its own (ModelConfig.module_shapes:
    # fused qkv_proj / gate_up_proj, no gate_proj); () is the Llama set below.
    modules: tuple[tuple[str, int, int], ...] = ()
    # LoRA-targetable modules outside the layers (contracts/head_modules.py): laid out on one
    # device only; an adapter targeting them is refused by a plan of several ranks.
    head_modules: tuple[HeadModule, ...] = ()

    def __post_init__(self) -> None:
        n = self.world_size
        unsplit = [m for m, _, _ in self.modules if m not in COLUMN_PARALLEL + ROW_PARALLEL]
        if n > 1 and unsplit:
            raise ValueError(f"the projections {unsplit} are not split over ranks: "
                             f"serve this model with tensor_parallel_size=1")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if self.num_heads % n:
            raise ValueError(f"cannot split {self.num_heads} attention heads over {n} ranks: "
                             f"tensor_parallel_size must divide num_attention_heads")
        if self.num_kv_heads % n:
            # Replicating KV heads (vLLM does when kv heads < N) would store one head N times.
            raise ValueError(f"cannot split {self.num_kv_heads} key/value heads over {n} ranks: "
                             f"tensor_parallel_size must divide num_key_value_heads")
        if self.intermediate_size % n:
            raise ValueError(f"cannot split intermediate_size={self.intermediate_size} over {n} ranks")
        if self.hidden_size % n:  # the LoRA B of o/down splits along hidden
            raise ValueError(f"cannot split hidden_size={self.hidden_size} over {n} ranks")

    @classmethod
    def for_model(cls, cfg, world_size: int) -> TensorParallelPlan:
        """From any object with ModelConfig's fields (the engine's ModelConfig)."""
        shapes = cfg.module_shapes() if hasattr(cfg, "module_shapes") else {}
        heads = tuple(cfg.head_modules().values()) if hasattr(cfg, "head_modules") else ()
        blocker = cfg.tp_blocker() if world_size != 1 and hasattr(cfg, "tp_blocker") else None
        if blocker:  # a family whose weights the ranks cannot split (the engine's ModelConfig says why)
            raise ValueError(blocker)
        return cls(world_size=world_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   vocab_size=cfg.vocab_size, modules=tuple((m, fi, fo) for m, (fi, fo) in shapes.items()),
                   head_modules=heads)

    @classmethod
    def configured(cls, cfg, world_size: int) -> TensorParallelPlan:
        """for_model at start-up (engine, cache manager): a model that cannot split N ways is a
        ConfigError naming model.tensor_parallel_size, which a child reports in one line."""
        try:
            return cls.for_model(cfg, world_size)
        except ValueError as exc:
            raise ConfigError(f"model.tensor_parallel_size={world_size}: {exc}", "model.tensor_parallel_size") \
                from None

    # ---- base model shards -------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads // self.world_size

    @property
    def kv_dim(self) -> int:
        """KV elements per token and layer on one rank (its KV heads only)."""
        return self.kv_heads * self.head_dim

    @property
    def vocab_shard(self) -> int:
        return _ceil_div(self.vocab_size, self.world_size)

    def full_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every projection of the unsplit model."""
        if self.modules:
            return {m: (fi, fo) for m, fi, fo in self.modules}
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def fused_parts(self, module: str) -> tuple[int, ...]:
        """Out-features of each projection a column-parallel `module` concatenates: rank i holds slice i
        of every part, in order (its own q, k, v heads; its gate and up columns); one part unfused."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if module == "qkv_proj":
            return (q, kv, kv)
        if module == "gate_up_proj":
            return (self.intermediate_size, self.intermediate_size)
        return (self.full_shapes()[module][1],)

    def shard_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of one rank's slice of every projection."""
        n = self.world_size
        return {name: (fi, fo // n) if name in COLUMN_PARALLEL else (fi // n, fo)
                for name, (fi, fo) in self.full_shapes().items()}

    # ---- LoRA shards -------------------------------------------------------------------------
    def lora_rank_shard(self, rank: int) -> int:
        """Rows of a column-parallel A on one rank: ceil(r / N) (the last ranks' extra rows are zero)."""
        return _ceil_div(rank, self.world_size)

    def lora_rows(self, module: str, rank: int) -> tuple[int, int, int, int]:
        """(A rows, A row width, B^T rows, B^T row width) one rank stores for `module` at LoRA `rank`."""
        n = self.world_size
        head = next((h for h in self.head_modules if h.name == module), None)
        if head is not None:
            if n > 1:
                raise ValueError(f"LoRA on {module} is not split over tensor-parallel ranks yet: serve this adapter "
                                 "on an engine with tensor_parallel_size=1, or retrain it without that target")
            return head.lora_rows(rank)
        fan_in, fan_out = self.full_shapes()[module]
        if module in COLUMN_PARALLEL:
            rs = self.lora_rank_shard(rank)
            return rs, fan_in, rs * n, fan_out // n
        return rank, fan_in // n, rank, fan_out // n

    def geometry(self, page_tokens: int | None = None) -> PageGeometry:
        """Every rank's page geometry: its KV heads per page, and rows as wide as its widest LoRA row."""
        widths = {name: (a_w, b_w) for name, (_, a_w, _, b_w) in
                  ((m, self.lora_rows(m, 1)) for m in self.full_shapes())}
        return PageGeometry.for_model(widths, self.kv_dim, page_tokens)

    def adapter_layout(self, geometry: PageGeometry, targets: list[str] | tuple[str, ...],
                       rank: int) -> AdapterLayout:
        """Where an adapter's shard sits in its pages: computed from shapes only, hence the same
        on every rank, so the daemon's page table for the adapter is valid on all of them."""
        if rank <= 0:
            raise ValueError("rank must be positive")
        return pack_adapter_rows(geometry, {m: self.lora_rows(m, rank) for m in targets}, rank)

    # ---- communication per token (elements of each collective's result) ---------------------
    def base_comm_per_layer(self) -> int:
        """The two all-reduces of a layer's row-parallel outputs (o_proj, down_proj)."""
        return 0 if self.world_size == 1 else 2 * self.hidden_size

    def base_comm_per_model(self) -> dict[str, int]:
        """Once per token, outside the layers: the embedding all-reduce; per sampled token the logits gather."""
        if self.world_size == 1:
            return {"embed": 0, "lm_head": 0}
        return {"embed": self.hidden_size, "lm_head": self.vocab_shard * self.world_size}

    def lora_comm(self, module: str, rank: int) -> int:
        """S-LoRA: the all-gather of x·A (r padded to N) or the all-reduce of the partial x·A (r);
        the B side of a row-parallel module rides the base all-reduce."""
        if self.world_size == 1:
            return 0
        if module in COLUMN_PARALLEL:
            return self.lora_rank_shard(rank) * self.world_size
        return rank

    def naive_lora_comm(self, module: str) -> int:
        """The naive partition: each module's LoRA output all-gathered whole (out_features)."""
        return 0 if self.world_size == 1 else self.full_shapes()[module][1]
