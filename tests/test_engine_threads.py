"""model.cpu_threads: one declaration, checked like every engine setting, resolved by the engine
(auto: the process's share of the usable cores less one) and applied to torch in every engine
process; the offline LLM keeps its caller's thread count unless told."""
from __future__ import annotations

import pytest
import torch

from loraplex.contracts import host
from loraplex.contracts.engine_spec import EngineSpec
from loraplex.contracts.settings import ConfigError
from loraplex.daemon.config_load import load_config
from loraplex.gpu_engine import runtime


@pytest.mark.parametrize(("cores", "ranks", "want"), [(1, 1, 1), (2, 1, 1), (4, 1, 3), (16, 1, 15),
                                                      (16, 2, 7), (16, 4, 3), (2, 4, 1), (3, 2, 1)])
def test_auto_leaves_a_core_of_the_share(cores, ranks, want):
    assert runtime.auto_cpu_threads(cores, ranks) == want


def test_resolve_spec_fills_auto_and_keeps_a_set_count(monkeypatch):
    monkeypatch.setattr(runtime, "usable_cores", lambda: 8)
    assert runtime.resolve_spec(EngineSpec(model="/m", device="cpu")).cpu_threads == 7
    assert runtime.resolve_spec(EngineSpec(model="/m", device="cpu", tensor_parallel_size=2)).cpu_threads == 3
    assert runtime.resolve_spec(EngineSpec(model="/m", device="cpu", cpu_threads=5)).cpu_threads == 5


def test_usable_cores_is_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {5, 0, 3}, raising=False)
    assert host.allowed_cores() == [0, 3, 5] and host.usable_cores() == 3
    monkeypatch.delattr(host.os, "sched_getaffinity", raising=False)  # not Linux: every core the OS reports
    monkeypatch.setattr(host.os, "cpu_count", lambda: 4)
    assert host.allowed_cores() == [0, 1, 2, 3] and host.usable_cores() == 4
    monkeypatch.setattr(host.os, "cpu_count", lambda: None)
    assert host.usable_cores() == 1


@pytest.mark.parametrize("bad", [0, -2])
def test_a_non_positive_count_is_refused_naming_the_key(bad, tmp_path):
    with pytest.raises(ConfigError, match="cpu_threads must be positive"):
        EngineSpec(cpu_threads=bad)
    toml = tmp_path / "loraplex.toml"
    toml.write_text(f"[model]\ncpu_threads = {bad}\n")
    with pytest.raises(ConfigError, match="model.cpu_threads must be positive"):
        load_config(toml, env={})


def test_the_setting_reaches_the_engine_spec(tmp_path):
    assert load_config(None, env={}).engine_spec().cpu_threads is None  # auto
    assert load_config(None, env={"LORAPLEX_MODEL_CPU_THREADS": "3"}).engine_spec().cpu_threads == 3
    toml = tmp_path / "loraplex.toml"
    toml.write_text("[model]\ncpu_threads = 2\n")
    assert load_config(toml, env={}).engine_spec().cpu_threads == 2


def test_build_runtime_applies_it_and_the_offline_llm_keeps_the_callers(demo):
    from loraplex import LLM

    before = torch.get_num_threads()
    try:
        LLM(demo.model_dir, num_pages=16)
        assert torch.get_num_threads() == before, "an in-process engine keeps the caller's threads"
        LLM(demo.model_dir, num_pages=16, cpu_threads=1)
        assert torch.get_num_threads() == 1
        runtime.build_runtime(EngineSpec(model=str(demo.model_dir), device="cpu", num_pages=16, cpu_threads=2),
                              max_num_seqs=4)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
