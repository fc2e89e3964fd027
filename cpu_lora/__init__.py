"""CPU LoRA worker pool for CPU-assisted prefill (Toppings §4.2; docs/architecture.md, "CPU-assisted prefill").

`pool` (daemon side, torch-free) starts and supervises one worker process per
core; `worker` (one process, one core, one thread) computes LoRA deltas from
the host adapter store into the activation exchange; `compute` is their
kernel; `calibration` measures it and plans how many workers a prompt needs.
This package imports nothing at import time, so the torch-free daemon can
use `pool` and `calibration` without loading torch.
"""
