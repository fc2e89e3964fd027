"""Contracts the daemon and the engine side share, torch-free: the unified pool's page
geometry (geometry), the split of a model's layers into load groups (layer_groups),
the rule every adapter name obeys (names), where the built-in demo lives (demo) and the
cores this process may run on (host).
Both sides import these; neither owns them, so neither side has to import the other.
"""
