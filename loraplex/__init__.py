"""loraplex: serve many LoRA adapters over one base LLM on one node.

The root package holds only the version and the command line; the parts live in
loraplex.gpu_engine, loraplex.daemon, loraplex.ipc, loraplex.cpu_lora, loraplex.kernels, loraplex.tui.
"""
__version__ = "0.1.0"
