"""Textual admin console (torch-free)."""
