"""GPU adapter-cache policy pieces (torch-free): eviction policies, per-adapter
counters and the arrival predictor. The residency that applies them lives in
loraplex.daemon.memory.adapter_residency."""
from loraplex.daemon.gpu_cache.counters import AdapterUsage, CacheTotals
from loraplex.daemon.gpu_cache.policies import (
    POLICY_NAMES,
    CostPolicy,
    CostWeights,
    EvictionPolicy,
    FifoPolicy,
    LruPolicy,
    NonePolicy,
    make_policy,
)
from loraplex.daemon.gpu_cache.predictor import ArrivalPredictor, PredictorConfig

__all__ = [
    "POLICY_NAMES", "AdapterUsage", "ArrivalPredictor", "CacheTotals", "CostPolicy", "CostWeights",
    "EvictionPolicy", "FifoPolicy", "LruPolicy", "NonePolicy", "PredictorConfig", "make_policy",
]
