"""cpu_lora.calibration: measured throughputs are positive, profiles interpolate
and cache, and plan_parallelism gives ceil(L / c) workers with a row split
that covers the prompt exactly (Toppings §4.2)."""
from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from loraplex.cpu_lora.calibration import (
    CALIBRATION_RANKS,
    CpuProfile,
    calibrate_local,
    load_or_calibrate,
    load_profile,
    module_work,
    plan_parallelism,
    profile_path,
    save_profile,
    split_rows,
)
from loraplex.ipc.protocol import CpuCalibration


def flat_profile(rate: float = 10_000.0, hidden: int = 4096) -> CpuProfile:
    """rate tokens/s at rank 16, time per token proportional to rank."""
    ranks = CALIBRATION_RANKS
    return CpuProfile(hidden=hidden, ranks=ranks, tokens_per_s=tuple(rate * 16 / r for r in ranks),
                      cpu_model="test-cpu", torch_version="0")


def test_calibration_gives_positive_throughputs_falling_with_rank() -> None:
    profile = calibrate_local(hidden=128, ranks=(8, 32, 128), tokens=64, repeats=3)
    assert profile.ranks == (8, 32, 128) and profile.hidden == 128
    assert all(math.isfinite(t) and t > 0 for t in profile.tokens_per_s)
    # 16x the arithmetic at rank 128 cannot be faster than rank 8 on one core.
    assert profile.tokens_per_s[0] > profile.tokens_per_s[2]
    assert profile.cpu_model and profile.torch_version


def test_calibration_in_bf16() -> None:
    profile = calibrate_local(hidden=64, ranks=(8,), tokens=16, repeats=1, dtype="bfloat16")
    assert profile.dtype == "bfloat16" and profile.tokens_per_s[0] > 0


@pytest.mark.parametrize("prompt_len", [1, 99, 100, 101, 250, 1000, 4097])
def test_plan_gives_ceil_of_prompt_over_capacity(prompt_len: int) -> None:
    profile = flat_profile(10_000.0)
    plan = plan_parallelism(prompt_len, 16, profile, per_request_budget_ms=10.0)
    c = 100  # 10k tokens/s x 10 ms
    assert plan.capacity == c
    assert plan.num_workers == math.ceil(prompt_len / c)
    assert plan.within_budget
    assert sum(count for _, count in plan.splits) == prompt_len
    assert max(count for _, count in plan.splits) <= c
    assert plan.expected_ms <= 10.0 + 1e-9


def test_plan_scales_with_rank_work_and_cap() -> None:
    profile = flat_profile(10_000.0)
    assert plan_parallelism(1000, 32, profile, 10.0).capacity == 50  # twice the rank, half the tokens
    assert plan_parallelism(1000, 16, profile, 10.0, work_units=4.0).capacity == 25
    capped = plan_parallelism(1000, 16, profile, 10.0, max_workers=3)
    assert capped.num_workers == 3 and not capped.within_budget
    assert capped.expected_ms > 10.0
    tiny = plan_parallelism(5, 128, profile, 0.001)  # less than a token fits: one token per core
    assert tiny.capacity == 1 and tiny.num_workers == 5


def test_plan_rejects_bad_arguments() -> None:
    profile = flat_profile()
    for kwargs in ({"prompt_len": 0}, {"per_request_budget_ms": 0.0}, {"work_units": -1.0}, {"max_workers": 0}):
        args = {"prompt_len": 10, "rank": 8, "profile": profile, "per_request_budget_ms": 5.0, **kwargs}
        with pytest.raises(ValueError):
            plan_parallelism(**args)


def test_module_work_of_llama_projections() -> None:
    assert module_work(4096, 4096, 4096) == 1.0
    assert module_work(4096, 1024, 4096) == pytest.approx(0.625)  # k/v with GQA
    assert module_work(11008, 4096, 4096) == pytest.approx(1.84375)  # down_proj


@pytest.mark.parametrize("total, parts", [(0, 3), (1, 4), (10, 3), (100, 7), (7, 7), (5, 1)])
def test_split_rows_covers_exactly(total: int, parts: int) -> None:
    splits = split_rows(total, parts)
    assert all(count > 0 for _, count in splits)
    assert len(splits) == min(parts, total)
    position = 0
    for start, count in splits:
        assert start == position
        position += count
    assert position == total
    if splits:
        sizes = [count for _, count in splits]
        assert max(sizes) - min(sizes) <= 1


def test_throughput_interpolates_in_time_per_token() -> None:
    profile = CpuProfile(hidden=64, ranks=(8, 16), tokens_per_s=(2000.0, 1000.0), cpu_model="c", torch_version="t")
    assert profile.throughput(8) == 2000.0
    assert profile.throughput(4) == 2000.0  # never more optimistic than the smallest measured rank
    assert profile.throughput(12) == pytest.approx(1 / ((1 / 2000 + 1 / 1000) / 2))
    assert profile.throughput(32) == pytest.approx(500.0)  # proportional above the largest rank
    with pytest.raises(ValueError):
        profile.throughput(0)


@pytest.mark.parametrize("bad", [{"ranks": (16, 8)}, {"tokens_per_s": (1.0, 0.0)}, {"tokens_per_s": (1.0,)}])
def test_profile_validation(bad: dict) -> None:
    fields = {"hidden": 64, "ranks": (8, 16), "tokens_per_s": (2.0, 1.0), "cpu_model": "c", "torch_version": "t"}
    with pytest.raises(ValueError):
        CpuProfile(**{**fields, **bad})


def test_profile_cache_round_trip(tmp_path: Path) -> None:
    profile = CpuProfile(hidden=256, ranks=CALIBRATION_RANKS, tokens_per_s=(5.0, 4.0, 3.0, 2.0, 1.0))
    path = save_profile(profile, tmp_path)
    assert path == profile_path(256, cache_dir=tmp_path) and path.is_file()
    assert load_profile(256, cache_dir=tmp_path) == profile
    assert load_profile(512, cache_dir=tmp_path) is None  # keyed by hidden size
    assert load_profile(256, dtype="bfloat16", cache_dir=tmp_path) is None
    assert load_profile(256, ranks=(8, 256), cache_dir=tmp_path) is None  # a rank it never measured
    path.write_text("{not json")
    assert load_profile(256, cache_dir=tmp_path) is None
    path.write_text(json.dumps({**profile.to_json(), "version": 99}))
    assert load_profile(256, cache_dir=tmp_path) is None


class FakePool:
    """Answers calibrate() like a worker would, counting calls."""

    def __init__(self) -> None:
        self.calls = 0

    async def calibrate(self, hidden: int, ranks: list[int], **kwargs: object) -> CpuCalibration:
        self.calls += 1
        return CpuCalibration(request_id=1, index=0, hidden=hidden, tokens=int(kwargs["tokens"]),
                              ranks=list(reversed(ranks)), tokens_per_s=[float(r) for r in reversed(ranks)])


def test_load_or_calibrate_measures_once_then_uses_the_cache(tmp_path: Path) -> None:
    pool = FakePool()
    first = asyncio.run(load_or_calibrate(pool, 128, ranks=(8, 16), tokens=32, cache_dir=tmp_path))
    assert first.ranks == (8, 16) and first.tokens_per_s == (8.0, 16.0)  # sorted by rank
    again = asyncio.run(load_or_calibrate(pool, 128, ranks=(8, 16), tokens=32, cache_dir=tmp_path))
    assert again == first and pool.calls == 1
    asyncio.run(load_or_calibrate(pool, 128, ranks=(8, 16), tokens=32, cache_dir=tmp_path, refresh=True))
    assert pool.calls == 2
