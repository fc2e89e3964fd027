"""The model executor side of loraplex: model loading, the unified pool tensors,
unmerged multi-LoRA, sampling, the engine and cache manager processes. Never imports
the daemon; the offline API that composes both lives above them (loraplex.offline)."""
