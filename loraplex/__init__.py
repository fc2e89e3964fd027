"""loraplex: serve many LoRA adapters over one base LLM on one node.

The root package holds only the version, the command line and the warm-spare launcher
(loraplex.standby, which must not import torch on its main thread); the parts live in
loraplex.gpu_engine, loraplex.daemon, loraplex.ipc, loraplex.cpu_lora, loraplex.kernels, loraplex.tui.
"""
__version__ = "0.1.0"
