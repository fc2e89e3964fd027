"""Reduction combine functions for `tl.reduce`, shared by the kernels.

Kernels here call no @jit helper of triton.language.standard (`tl.sum`,
`tl.max`, `tl.zeros`, `tl.cdiv`): they use `tl.reduce` with the very combine
functions those wrap (same IR for float32 inputs) and `tl.full`. Under
TRITON_INTERPRET=1 a nested @jit call re-patches triton.language (~1 ms each),
and fails outright when triton was imported before the variable was set (as
transformers does); builtins and these combine functions, which the
interpreter maps to numpy by identity, avoid both. Import only from kernel modules.
"""
from __future__ import annotations

import triton.language as tl

SUM = tl.standard._sum_combine  # tl.reduce(x, axis, SUM) == tl.sum(x, axis) for float32 x
MAX = tl.standard._elementwise_max  # tl.reduce(x, axis, MAX) == tl.max(x, axis) for float32 x
