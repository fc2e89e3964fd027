"""Triton kernels for multi-LoRA and paged attention over the unified pool, one op per module,
each with a launcher that checks its arguments and a torch reference beside it.

- `lora_bgmv`: decode LoRA, one token per row, tiles padded to the batch's max rank (Punica BGMV).
- `lora_mbgmv`: decode LoRA, each row looping over its own rank only (MBGMV).
- `lora_sgmv`: prefill LoRA over adapter-sorted token segments, a rank per segment (SGMV/MBGMM).
- `paged_attention_prefill`: causal variable-length attention, GQA, sliding window.
- `paged_attention_decode`: flash-decoding split over the context plus a reduction.
- `lora_tables` / `paged_kv`: the metadata the kernels read and the references they must equal.
- `runtime`: where kernels may run (CUDA, or CPU under TRITON_INTERPRET=1), argument checks, and
  `KernelLaunch`, what each launcher's pure `*_launch` choice function returns.
- `launch_space` / `compile_check`: the engine's input domain, every distinct launch the choice
  functions make over it, and their compile for sm_90 / sm_80 with registers, spills, shared memory.

Importing this package does not import triton; the op modules do (set TRITON_INTERPRET first).
"""
