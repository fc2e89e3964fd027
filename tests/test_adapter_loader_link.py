"""The CPU load throttle models one shared link: concurrent loads queue behind each other."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from loraplex.gpu_engine.adapter_loader import AdapterLoader


def _loader(bytes_per_s: float) -> AdapterLoader:
    return AdapterLoader(SimpleNamespace(data=torch.empty(2, 4)), throttle_bytes_per_s=bytes_per_s)


def test_second_load_is_booked_after_the_first():
    loader = _loader(1000.0)
    before = time.perf_counter()
    first = loader._book_link([100, 300])
    second = loader._book_link([200])
    after = time.perf_counter()
    assert before + 0.1 <= first[0] <= after + 0.1
    assert first[1] - first[0] == pytest.approx(0.3, abs=1e-9)
    # The second load starts where the first ends, not now: one link, not one per load.
    assert second[0] - first[1] == pytest.approx(0.2, abs=1e-9)


def test_an_idle_link_starts_now():
    loader = _loader(1e6)
    loader._book_link([1000])  # ends 1 ms from now
    time.sleep(0.01)
    before = time.perf_counter()
    (arrival,) = loader._book_link([2000])
    assert before + 0.002 <= arrival <= time.perf_counter() + 0.002
