"""Llama-family model definition: config parsing, weight loading, RoPE, forward pass."""
