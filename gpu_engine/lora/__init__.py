"""Unmerged multi-LoRA: PEFT adapter loading/validation and the torch reference backend."""
