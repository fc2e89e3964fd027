"""Online estimators the policies share (torch-free): step latency as a function
of batched tokens, and per-adapter output length.

Both learn from what the engine reports and start from stated priors, so a
fresh scheduler already predicts something sensible. Neither blocks or sleeps.
"""
from __future__ import annotations

import math
from collections import deque


class StepCostModel:
    """step_ms ≈ per_token_ms · tokens + base_ms, fitted by exponentially weighted least
    squares over the observed (tokens, step ms) pairs. The prior enters as two
    pseudo-observations (at 1 and at `prior_tokens` tokens) that decay like real ones."""

    def __init__(self, per_token_ms: float = 0.05, base_ms: float = 5.0, *, decay: float = 0.98,
                 prior_tokens: int = 256, prior_weight: float = 2.0) -> None:
        if per_token_ms < 0 or base_ms < 0 or not 0 < decay <= 1:
            raise ValueError("StepCostModel needs per_token_ms >= 0, base_ms >= 0 and 0 < decay <= 1")
        self.decay = decay
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        for x in (1.0, float(prior_tokens)):
            self._add(x, base_ms + per_token_ms * x, prior_weight)
        self.observations = 0

    def _add(self, x: float, y: float, w: float) -> None:
        self._sw += w
        self._sx += w * x
        self._sy += w * y
        self._sxx += w * x * x
        self._sxy += w * x * y

    def observe(self, tokens: int, step_ms: float) -> None:
        if tokens <= 0 or not math.isfinite(step_ms) or step_ms < 0:
            return
        d = self.decay
        self._sw, self._sx, self._sy, self._sxx, self._sxy = (
            self._sw * d, self._sx * d, self._sy * d, self._sxx * d, self._sxy * d)
        self._add(float(tokens), step_ms, 1.0)
        self.observations += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        """(per_token_ms, base_ms), both clamped at zero."""
        var = self._sxx * self._sw - self._sx * self._sx
        if var <= 1e-12:
            return 0.0, max(0.0, self._sy / self._sw)
        slope = max(0.0, (self._sxy * self._sw - self._sx * self._sy) / var)
        base = max(0.0, (self._sy - slope * self._sx) / self._sw)
        return slope, base

    def predict_ms(self, tokens: int) -> float:
        slope, base = self.coefficients
        return max(1e-3, base + slope * max(0, tokens))

    def predict_s(self, tokens: int) -> float:
        return self.predict_ms(tokens) / 1e3


class OutputLengthPredictor:
    """Output length per adapter as a running quantile of the last `window` finished
    requests of that adapter (the global window until it has `min_samples`), always
    capped by the request's own max_tokens."""

    def __init__(self, quantile: float = 0.5, *, window: int = 128, min_samples: int = 4, default: int = 128) -> None:
        if not 0 <= quantile <= 1 or window <= 0 or min_samples <= 0 or default <= 0:
            raise ValueError("OutputLengthPredictor: quantile in [0, 1], positive window/min_samples/default")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.default = default
        self._recent: dict[str | None, deque[int]] = {}
        self._global: deque[int] = deque(maxlen=window)
        self._sorted: dict[object, list[int]] = {}  # cache, invalidated on observe

    def observe(self, adapter: str | None, output_len: int) -> None:
        self._recent.setdefault(adapter, deque(maxlen=self.window)).append(output_len)
        self._global.append(output_len)
        self._sorted.pop(adapter, None)
        self._sorted.pop(_GLOBAL, None)

    def _quantile_of(self, key: object, values: deque[int]) -> int:
        ordered = self._sorted.get(key)
        if ordered is None:
            ordered = self._sorted[key] = sorted(values)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def predict(self, adapter: str | None, max_tokens: int) -> int:
        own = self._recent.get(adapter)
        if own is not None and len(own) >= self.min_samples:
            guess = self._quantile_of(adapter, own)
        elif self._global:
            guess = self._quantile_of(_GLOBAL, self._global)
        else:
            guess = self.default
        return max(1, min(max_tokens, guess))


_GLOBAL = object()

