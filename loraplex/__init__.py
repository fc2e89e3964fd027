"""loraplex: serve many LoRA adapters over one base LLM on one node.

The root package holds the version, the command line, the shared error types, the
contracts both sides share (loraplex.contracts), the warm-spare launcher
(loraplex.standby, which must not import torch on its main thread) and the offline API
(loraplex.offline). The parts live in loraplex.daemon, loraplex.ipc, loraplex.gpu_engine,
loraplex.cpu_lora, loraplex.kernels, loraplex.tui and loraplex.gateway.

`from loraplex import LLM, SamplingParams` loads the offline API on first use, so
`import loraplex` alone (every client, the gateway, the console) never imports torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The serving side is the `engine` extra; these are the modules it brings.
ENGINE_MODULES = ("torch", "safetensors")
ENGINE_INSTALL = "pip install 'loraplex[engine]'"

# Names the root hands on lazily: name -> the module that defines it.
_LAZY = {"LLM": "loraplex.offline", "RequestOutput": "loraplex.offline", "SamplingParams": "loraplex.offline",
         "Guided": "loraplex.ipc.guided"}

__all__ = ["LLM", "Guided", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from loraplex.ipc.guided import Guided
    from loraplex.offline import LLM, RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ENGINE_MODULES:
            raise
        raise ModuleNotFoundError(f"loraplex.{name} needs the engine side ({exc.name} is not installed): "
                                  f"{ENGINE_INSTALL}", name=exc.name) from exc
    globals()[name] = value  # later lookups skip this hook
    return value
