"""Triton kernels for multi-LoRA and paged attention, each with a torch reference."""
