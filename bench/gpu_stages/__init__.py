"""The four stages of the GPU validation (bench/gpu_check.py), in the order they run."""
from __future__ import annotations

STAGES = ("build-test", "kernels", "e2e", "cpu-many-core")
