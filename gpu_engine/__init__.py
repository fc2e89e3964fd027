"""The model executor side of loraplex: model loading, the unified pool tensors,
unmerged multi-LoRA, sampling, and the offline `LLM` API built on them."""
from loraplex.gpu_engine.llm import LLM, RequestOutput
from loraplex.gpu_engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
