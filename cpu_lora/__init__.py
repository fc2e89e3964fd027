"""CPU LoRA worker pool for CPU-assisted prefill."""
