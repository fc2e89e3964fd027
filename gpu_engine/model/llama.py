"""The decoder forward pass of every served family (Llama, Mistral, Qwen2/3,
Gemma 1/2/3, Phi, Phi-3, GPT-2) over one continuous-batching step: prefill chunks
and decode tokens of many sequences flattened into one token axis, KV read and
written through the unified pool's page tables, and unmerged LoRA on every
targeted projection (a fused qkv_proj / gate_up_proj is one matmul and one LoRA
apply, split afterwards), on the token embedding and on the LM head.

One forward for all families, driven by ModelConfig's typed facts (norm kind,
activation, q/k norms, sandwich norms, parallel residual, learned positions,
soft-caps). Numerics follow transformers (norms.py) so results match it + PEFT.
The class keeps its first name, LlamaModel.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loraplex.gpu_engine.lora.backend import LoraBackend
from loraplex.gpu_engine.lora.torch_backend import LoraGroup, ResidentLora, embed_lora, lm_head_lora
from loraplex.gpu_engine.model.attention_torch import TorchPagedAttention
from loraplex.gpu_engine.model.batch import ForwardBatch
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.cpu_gemm import CpuGemm
from loraplex.gpu_engine.model.norms import activation, norm, rms_norm, softcap
from loraplex.gpu_engine.model.rope import Rotary
from loraplex.gpu_engine.model.weights import LayerWeights, ModelWeights
from loraplex.gpu_engine.pool import UnifiedPool

__all__ = ["LlamaModel", "rms_norm"]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, lora: LoraBackend,
                 attention: TorchPagedAttention | None = None, gemm: CpuGemm | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.lora = lora
        self.gemm = gemm or CpuGemm(enabled=False)  # the engine's: packed CPU weights (model.cpu_packed_weights)
        device = weights.embed.device
        self.rotary = Rotary(cfg, device)
        # Gemma 3's sliding layers rotate with their own base; every other model shares one table.
        self.local_rotary = Rotary(cfg, device, local=True) if cfg.local_rope_theta is not None else None
        self.attention = attention or TorchPagedAttention.for_config(cfg)
        # Gemma's sqrt(hidden) in the model dtype, as transformers rounds it; made once (never inside
        # a CUDA-graph capture)
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=weights.embed.dtype, device=device) \
            if cfg.embed_scaled else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: UnifiedPool) -> torch.Tensor:
        """Returns float32 logits [S, vocab] for the sampled tokens (and keeps the final states of
        batch.score_tokens in batch.scored_hidden)."""
        cfg = self.cfg
        h = self._embed(batch.token_ids)  # [T, hidden]
        self._embed_lora(batch, pool, h)
        if self.embed_scale is not None:  # after the LoRA: peft scales its output as the embedding's
            h = h * self.embed_scale
        if self.w.pos_embed is not None:
            h = h + F.embedding(batch.positions, self.w.pos_embed)
        tables = self._rope_tables(batch, h.dtype)
        cpu = batch.cpu
        for layer_idx, layer in enumerate(self.w.layers):
            flat = pool.layer_flat(layer_idx)
            groups = self._gpu_groups(batch, layer_idx)
            local = self.local_rotary is not None and cfg.layer_window(layer_idx) is not None
            cos, sin = tables[1 if local else 0]
            x = self._norm(layer, "input_norm", h)
            attn = self._attention(layer_idx, layer, x, cos, sin, batch, pool, flat, groups)
            if cpu is not None:
                cpu.post(layer_idx, 1, attn)
            o = self._proj(layer, "o_proj", attn, flat, groups)
            if cpu is not None:
                cpu.collect(layer_idx, 1, attn, {"o_proj": o})
            if cfg.parallel_residual:  # Phi: the MLP reads the same normed input as attention
                h = h + o + self._mlp(layer_idx, layer, x, flat, groups, cpu)
                continue
            if cfg.sandwich_norm:
                o = self._norm(layer, "attn_out_norm", o)
            h = h + o
            m = self._mlp(layer_idx, layer, self._norm(layer, "post_norm", h), flat, groups, cpu)
            if cfg.sandwich_norm:
                m = self._norm(layer, "mlp_out_norm", m)
            h = h + m
        if batch.score_tokens is not None:  # prompt logprobs: scored later, in chunks (rows are normed alone)
            batch.scored_hidden = self._final_norm(h.index_select(0, batch.score_tokens))
        last = self._final_norm(h.index_select(0, batch.sample_tokens))
        return self.logits(last, pool, batch.sample_heads)

    def logits(self, last: torch.Tensor, pool: UnifiedPool | None = None,
               heads: list[tuple[int, int, ResidentLora]] = ()) -> torch.Tensor | None:
        """float32 logits of final normed states after the family's final soft-cap (Gemma 2); the
        prompt logprobs' chunks go through it too. heads: rows [start, end) of `last` whose adapter
        may adapt lm_head (read from `pool`). None on a tensor-parallel rank that does not sample."""
        logits = self._logits(last)
        if logits is None:
            return None
        if heads:
            lm_head_lora(pool, heads, last, logits)
        return softcap(logits, self.cfg.final_softcap)

    @staticmethod
    def _embed_lora(batch: ForwardBatch, pool: UnifiedPool, h: torch.Tensor) -> None:
        groups = [g for g in batch.lora_groups if "embed_tokens" in g.lora.heads]
        for g in groups:  # a load's first layer group carries the head modules' parts
            if g.load is not None:
                batch.load_wait_ms += g.load.wait_layer(0)
        if groups:
            embed_lora(pool, groups, batch.token_ids, h)

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return norm(self.cfg.norm, h, self.w.norm, self.w.norm_bias, self.cfg.rms_norm_eps)

    def _norm(self, layer: LayerWeights, name: str, x: torch.Tensor) -> torch.Tensor:
        return norm(self.cfg.norm, x, layer.norm(name), layer.norm_bias.get(name), self.cfg.rms_norm_eps)

    def _rope_tables(self, batch: ForwardBatch, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ends = None
        # longrope picks its factors per row (a decode graph's rows are one token each: per token is the same)
        if self.rotary.long_from is not None and batch.rows and batch.decode_rows is None:
            counts = torch.tensor([r.count for r in batch.rows], device=batch.positions.device)
            row_ends = torch.tensor([r.start_pos + r.count for r in batch.rows], device=batch.positions.device)
            ends = torch.repeat_interleave(row_ends, counts)
        tables = [self.rotary.cos_sin(batch.positions, dtype, ends)]
        if self.local_rotary is not None:
            tables.append(self.local_rotary.cos_sin(batch.positions, dtype))
        return tables

    # _embed, _proj and _logits are where a tensor-parallel rank (gpu_engine/tp/model.py) differs.
    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.w.embed)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear("lm_head", last, self.w.lm_head, self.w.lm_head_bias).float()

    def _gpu_groups(self, batch: ForwardBatch, layer: int) -> list[LoraGroup]:
        """Adapter segments whose LoRA runs from the pool at this layer; waits for layer groups in flight."""
        groups = [g for g in batch.lora_groups if g.on_gpu(layer)]
        for g in groups:
            if g.load is not None:
                batch.load_wait_ms += g.load.wait_layer(layer)
        return groups

    def _proj(self, layer: LayerWeights, name: str, x: torch.Tensor, flat: torch.Tensor,
              groups: list[LoraGroup]) -> torch.Tensor:
        out = self.gemm.linear((id(layer), name), x, layer.proj[name], layer.bias.get(name))
        if groups:
            self.lora.apply(out, x, flat, name, groups)
        return out

    def _mlp(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, flat: torch.Tensor,
             groups: list[LoraGroup], cpu) -> torch.Tensor:
        cfg = self.cfg
        if cpu is not None:
            cpu.post(layer_idx, 2, x)
        if cfg.fused_gate_up:
            gate_up = self._proj(layer, "gate_up_proj", x, flat, groups)
            outs = {"gate_up_proj": gate_up}
            gate, up = gate_up.chunk(2, dim=-1)
        elif cfg.gated_mlp:
            gate = self._proj(layer, "gate_proj", x, flat, groups)
            up = self._proj(layer, "up_proj", x, flat, groups)
            outs = {"gate_proj": gate, "up_proj": up}
        else:
            gate, up = None, self._proj(layer, "up_proj", x, flat, groups)
            outs = {"up_proj": up}
        if cpu is not None:
            cpu.collect(layer_idx, 2, x, outs)
        act = activation(cfg.activation, up) if gate is None else activation(cfg.activation, gate) * up
        if cpu is not None:
            cpu.post(layer_idx, 3, act)
        down = self._proj(layer, "down_proj", act, flat, groups)
        if cpu is not None:
            cpu.collect(layer_idx, 3, act, {"down_proj": down})
        return down

    def _qkv(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch, flat: torch.Tensor,
             groups: list[LoraGroup]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if batch.cpu is not None:
            batch.cpu.post(layer_idx, 0, x)
        if cfg.fused_qkv:
            qkv = self._proj(layer, "qkv_proj", x, flat, groups)
            outs = {"qkv_proj": qkv}
            q, k, v = qkv.split((cfg.q_dim, cfg.kv_dim, cfg.kv_dim), dim=-1)
        else:
            q = self._proj(layer, "q_proj", x, flat, groups)
            k = self._proj(layer, "k_proj", x, flat, groups)
            v = self._proj(layer, "v_proj", x, flat, groups)
            outs = {"q_proj": q, "k_proj": k, "v_proj": v}
        if batch.cpu is not None:
            batch.cpu.collect(layer_idx, 0, x, outs)
        return q, k, v

    def _attention(self, layer_idx: int, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, pool: UnifiedPool, flat: torch.Tensor,
                   groups: list[LoraGroup]) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.shape[0]
        q, k, v = self._qkv(layer_idx, layer, x, batch, flat, groups)
        q = q.reshape(tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # per head, before RoPE (Qwen3, Gemma 3)
            q = self._norm(layer, "q_norm", q)
            k = self._norm(layer, "k_norm", k)
        if cfg.rope_dim:
            q = Rotary.apply(q, cos, sin)
            k = Rotary.apply(k, cos, sin)
        pool.write_kv(layer_idx, batch.kv_page_ids, batch.kv_slots, k.reshape(tokens, cfg.kv_dim),
                      v.contiguous())
        out = self.attention.forward(q.contiguous(), layer_idx, batch, pool)
        return out.view(tokens, cfg.q_dim)
