"""Tensor parallelism wired into the engine: the setting (spec, TOML, environment,
flag), N = 2 rank processes running protocol orders through the engine's own code
(mixed batches of base rows and adapters with odd ranks, rsLoRA, MLP targets, on the
GQA demo; dLoRA merged mode; layer-group loads) with the greedy tokens of one device
and its logprobs within fp32 tolerance; `loraplex serve --tensor-parallel-size 2` end to
end against transformers + PEFT; a rank SIGKILLed mid-stream; a rank SIGSTOPped
mid-stream, found by its silent heartbeat within seconds; a model that cannot split
refused at start."""
from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import time
from pathlib import Path

import pytest
import torch

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.contracts.settings import ConfigError
from loraplex.gpu_engine.demo import demo_model_config, write_random_adapter
from loraplex.gpu_engine.model.config import ModelConfig
from tests.daemon_process import DaemonProcess
from tests.tolerances import forward_tolerance
from tests.tp_engine_support import EngineCase, single_device, spawn_engine

DEMO_TOL = forward_tolerance(ModelConfig.from_hf(demo_model_config()))  # logprobs of two forwards
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ODD = {"odd-r5": (5, ALL, False), "odd-r7-rs": (7, ["q_proj", "v_proj", "o_proj", "down_proj"], True),
       "odd-r3-mlp": (3, ["gate_proj", "up_proj", "down_proj"], False)}
WORKER_MODULE = "loraplex.gpu_engine.tp.worker"


@pytest.fixture(scope="module")
def adapters(demo, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-engine-adapters")
    out = {name: str(path) for name, path in demo.adapters.items()}
    seed = int(torch.randint(0, 1 << 20, ()))  # fresh weights each run
    for i, (name, (rank, targets, rs)) in enumerate(ODD.items()):
        write_random_adapter(root / name, demo_model_config(), rank=rank, alpha=1.5 * rank, target_modules=targets,
                             seed=seed + i, use_rslora=rs)
        out[name] = str(root / name)
    return out


def _prompts(n: int, g: torch.Generator) -> list[list[int]]:
    return [torch.randint(3, 512, (int(k),), generator=g).tolist() for k in torch.randint(5, 30, (n,), generator=g)]


# ---- the setting ---------------------------------------------------------------------------------
def test_the_setting_and_its_refusals(tmp_path):
    from loraplex.cli import _SERVE_FLAGS
    from loraplex.daemon.config_load import load_config

    assert EngineSpec().tensor_parallel_size == 1
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="tensor_parallel_size must be positive"):
            EngineSpec(tensor_parallel_size=bad)
    assert EngineSpec(tensor_parallel_size=2, adapter_load_mode="cpu_assist").adapter_load_mode == "cpu_assist"
    with pytest.raises(ConfigError, match="lora_backend=triton is not supported"):
        EngineSpec(tensor_parallel_size=2, lora_backend="triton")
    toml = tmp_path / "loraplex.toml"
    toml.write_text("[model]\ntensor_parallel_size = 4\n")
    assert load_config(toml, env={}).engine_spec().tensor_parallel_size == 4
    assert load_config(None, env={"LORAPLEX_MODEL_TENSOR_PARALLEL_SIZE": "2"}).engine_spec().tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="model.lora_backend=triton"):
        load_config(None, env={"LORAPLEX_MODEL_TENSOR_PARALLEL_SIZE": "2", "LORAPLEX_MODEL_LORA_BACKEND": "triton"})
    assert ("--tensor-parallel-size", "model.tensor_parallel_size", int) in [f[:3] for f in _SERVE_FLAGS]


def test_auto_picks_what_tensor_parallelism_runs(monkeypatch):
    """On a (pretended) 4-GPU host: each rank its own GPU, the torch backend, on_demand loading."""
    from loraplex.gpu_engine import runtime

    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 4)
    spec = EngineSpec(model="/m", tensor_parallel_size=2, replica=1)
    ranks = [runtime.resolve_spec(spec, rank) for rank in (0, 1)]
    assert [r.device for r in ranks] == ["cuda:2", "cuda:3"]
    assert {(r.lora_backend, r.adapter_load_mode) for r in ranks} == {("torch", "on_demand")}
    one = runtime.resolve_spec(EngineSpec(model="/m"))
    assert (one.device, one.lora_backend, one.adapter_load_mode) == ("cuda:0", "triton", "cpu_assist")
    # cpu_assist under TP is the host path of CPU hosts: refused on CUDA (a fatal start failure), taken on CPU
    with pytest.raises(ConfigError, match="cpu_assist with tensor_parallel_size > 1 runs on CPU hosts only"):
        runtime.resolve_spec(EngineSpec(model="/m", tensor_parallel_size=2, adapter_load_mode="cpu_assist"))
    on_cpu = EngineSpec(model="/m", device="cpu", tensor_parallel_size=2, adapter_load_mode="cpu_assist")
    assert runtime.resolve_spec(on_cpu).adapter_load_mode == "cpu_assist"


def test_the_cache_manager_counts_the_ranks_pages(demo, adapters):
    """The daemon sizes adapters from the cache manager's counts: under TP the rank-independent
    shard layout (odd ranks pad the column-parallel side), with one rank the single-device layout."""
    from loraplex.contracts.geometry import plan_adapter_layout
    from loraplex.contracts.tensor_parallel import TensorParallelPlan
    from loraplex.gpu_engine.cache_manager_process import CacheManager
    from loraplex.gpu_engine.model.config import ModelConfig
    from loraplex.ipc.shm import segment_name

    cfg = ModelConfig.from_dir(demo.model_dir)
    for n in (1, 2):
        manager = CacheManager(EngineSpec(model=str(demo.model_dir), tensor_parallel_size=n, page_tokens=8,
                                          host_store_bytes=8 << 20,
                                          host_store_segment=segment_name(f"tpcm{os.getpid()}", f"s{n}")))
        try:
            reply = manager.load("odd-r5", adapters["odd-r5"])
        finally:
            manager.close()
        plan = TensorParallelPlan.for_model(cfg, n)
        assert reply.num_pages == plan.adapter_layout(plan.geometry(8), ALL, 5).num_pages
        if n == 1:
            geometry = plan.geometry(8)
            assert reply.num_pages == plan_adapter_layout(geometry, cfg.module_shapes(), ALL, 5).num_pages


# ---- ranks running the engine's orders -----------------------------------------------------------
def test_tp2_engine_orders_equal_one_device(demo, adapters, tmp_path):
    """Mixed batch (base rows, odd ranks, rsLoRA, MLP-only, GQA: 8 query heads over 4 KV heads), loads in
    layer groups; then dLoRA merged mode on every rank's shard; a bad adapter refused on every rank."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    names = [None, "odd-r5", "qv-r8", "odd-r5", "mlp-r64", None, "odd-r7-rs", "odd-r3-mlp", "rslora-r16"]
    used = {n: adapters[n] for n in names if n}
    mixed = EngineCase(str(demo.model_dir), used, _prompts(len(names), g), names, new_tokens=4,
                       extra={"bad_adapter": str(tmp_path / "missing")})
    merged_names = ["odd-r5"] * 3
    merged = EngineCase(str(demo.model_dir), {"odd-r5": adapters["odd-r5"]}, _prompts(3, g), merged_names,
                        new_tokens=3, merged="odd-r5", load_groups=1)
    unmerged = EngineCase(**{**merged.__dict__, "merged": None})
    reference = [single_device(case) for case in (mixed, merged, unmerged)]
    got = spawn_engine(2, [mixed, merged], tmp_path)
    for (ref_tokens, ref_logprobs), (tokens, logprobs), what in zip(reference, got, ("mixed", "merged")):
        assert torch.equal(tokens, ref_tokens), f"{what}: greedy tokens differ from one device"
        worst = (logprobs - ref_logprobs).abs().max().item()
        assert worst < DEMO_TOL, f"{what}: logprobs differ from one device by {worst}"
    assert torch.equal(got[1][0], reference[2][0]), "merged mode changed the tokens of the unmerged adapter"


def test_tp2_cpu_assisted_prefill_equals_one_device(demo, adapters, tmp_path):
    """Rank 0's CpuAssistEngine and two real CPU workers compute the prefill's adapter rows (all of the
    layers or the first only; attention and MLP targets, odd ranks, rsLoRA, an MLP-only adapter whose
    attention sites carry nothing) while every rank joins the gathers, scatters and broadcasts; greedy
    tokens and logprobs equal one device's without assist, with no site timed out. Then workers that never
    answer: rank 0 times out once and computes the rest itself, the ranks' collectives unchanged."""
    import dataclasses

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    names = [None, "odd-r5", "all-r32", "odd-r3-mlp", None, "odd-r7-rs", "qv-r8"]
    case = EngineCase(str(demo.model_dir), {n: adapters[n] for n in names if n}, _prompts(len(names), g), names,
                      new_tokens=3, cpu_assist=True)
    stalled = dataclasses.replace(case, prompts=_prompts(len(names), g), extra={"stalled_workers": True})
    cases = [case, stalled]
    reference = [single_device(dataclasses.replace(c, cpu_assist=False)) for c in cases]
    for c, (ref_tokens, ref_logprobs), (tokens, logprobs) in zip(cases, reference, spawn_engine(2, cases, tmp_path)):
        what = "stalled workers" if c.extra else "workers"
        assert torch.equal(tokens, ref_tokens), f"{what}: greedy tokens differ from one device without assist"
        worst = (logprobs - ref_logprobs).abs().max().item()
        assert worst < DEMO_TOL, f"{what}: logprobs differ from one device by {worst}"


def test_cpu_rows_without_assist_are_refused_on_every_rank(demo):
    """A plan with CPU rows for an engine not in cpu_assist mode fails on every rank alike, before any
    collective (a rank that went on would wait for the others); rank 0 alone brings the step run."""
    from loraplex.gpu_engine.model.config import ModelConfig
    from loraplex.gpu_engine.model_split import WholeModel
    from loraplex.gpu_engine.tp.comm import TpComm
    from loraplex.gpu_engine.tp.cpu_assist import AssistRow, TpCpuAssist
    from loraplex.gpu_engine.tp.shard import TpShard

    cfg = ModelConfig.from_dir(demo.model_dir)
    rows = [AssistRow(0, 4, 2, frozenset({"q_proj"}))]
    for split in (WholeModel(cfg), TpShard(cfg, TpComm(0, 2)), TpShard(cfg, TpComm(1, 2)),
                  TpShard(cfg, TpComm(0, 2), assisted=True)):  # rank 0 of an assisted engine without its exchange
        with pytest.raises(ValueError, match="no CPU assist is attached"):
            split.assist_step(None, rows)
    assert isinstance(TpShard(cfg, TpComm(1, 2), assisted=True).assist_step(None, rows), TpCpuAssist)
    with pytest.raises(ValueError, match="belongs to rank 0 only"):
        TpCpuAssist(TpComm(1, 2), object(), rows)


def test_ranks_that_disagree_on_a_load_drop_the_adapter_everywhere(demo, adapters, tmp_path):
    """settle: a load that failed on some ranks only leaves no rank holding the adapter (their pools
    would differ); one that failed on all leaves every rank as it was; a step failed elsewhere fails."""
    from loraplex.gpu_engine.engine_orders import EngineOrders
    from loraplex.gpu_engine.runtime import build_runtime
    from loraplex.ipc.engine_plan import StepPlan
    from loraplex.ipc.protocol import EngineAdapterLoaded, EngineFailure, EngineLoadAdapter, EngineStep

    orders = EngineOrders(build_runtime(EngineSpec(model=str(demo.model_dir), device="cpu", num_pages=64)))
    host = orders.runtime.executor.host
    load = EngineLoadAdapter(name="odd-r5", path=adapters["odd-r5"])
    loaded = orders.run(load)
    assert isinstance(loaded, EngineAdapterLoaded)
    assert orders.settle(load, loaded, 0, 0, 2) is loaded and "odd-r5" in host
    refused = EngineFailure(code="invalid_adapter", message="x", subject="odd-r5")
    assert orders.settle(load, refused, 2, 0, 2) is refused and "odd-r5" in host  # all failed alike
    reply = orders.settle(load, loaded, 1, 0, 2)
    assert isinstance(reply, EngineFailure) and "failed on 1 of 2 tensor-parallel ranks" in reply.message
    assert "odd-r5" not in host
    orders.run(load)
    assert orders.settle(load, refused, 1, 1, 2) is refused and "odd-r5" not in host  # this rank's own copy goes too
    step = EngineStep(plan=StepPlan(7, []))
    assert isinstance(orders.settle(step, orders.run(step), 1, 0, 2), EngineFailure)
    orders.close()


def test_a_model_that_cannot_split_fails_the_engine_start(demo, tmp_path):
    """8 attention heads do not split 3 ways: the engine refuses at start, before any rank runs,
    with the plan's reason as its fatal start failure."""
    import zmq.asyncio

    from loraplex.daemon.child_link import EngineRefused
    from loraplex.daemon.engine_link import EngineLink

    async def start() -> None:
        ctx = zmq.asyncio.Context()
        link = EngineLink(ctx, tmp_path, EngineSpec(model=str(demo.model_dir), tensor_parallel_size=3, num_pages=64))
        try:
            with pytest.raises(EngineRefused) as err:
                await link.start()
            assert err.value.failure.fatal
            assert "engine failed to start: model.tensor_parallel_size=3: cannot split 8 attention heads over 3" \
                in str(err.value), err.value
        finally:
            await link.stop()
            ctx.term()

    asyncio.run(start())


# ---- the daemon end to end -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_daemon(demo, adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-daemon")
    registered = [f"--adapter={name}={adapters[name]}" for name in ODD]
    proc = DaemonProcess(root, "--tensor-parallel-size", "2", *registered).start()
    yield proc
    status = proc.stop()
    assert status == 0, proc.log()


def _ranks_of(engine_pid: int) -> dict[int, int]:
    """rank -> pid of the engine's other ranks, found by their command lines (children of rank 0)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == engine_pid and WORKER_MODULE.encode() in argv:
            found[int(argv[argv.index(b"--rank") + 1])] = int(entry.name)
    return found


def test_serve_tp2_matches_peft_and_reports_its_ranks(tp_daemon, demo, adapters):
    from loraplex.cli import main as cli_main
    from loraplex.ipc.client import AsyncClient
    from tests.hf_reference import greedy

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    names = [None, "odd-r5", "all-r32", "odd-r7-rs", "mlp-r64", "odd-r3-mlp"]
    prompts = _prompts(len(names), g)

    async def run() -> list:
        async with AsyncClient(runtime_dir=tp_daemon.runtime_dir) as client:
            return await asyncio.gather(*[client.generate(p, adapter=a, max_tokens=6, temperature=0.0,
                                                          ignore_eos=True, timeout=60)
                                          for p, a in zip(prompts, names)])

    results = asyncio.run(run())  # one mixed batch of base rows and five adapters
    for name, prompt, got in zip(names, prompts, results):
        tokens, _ = greedy(demo.model_dir, adapters[name] if name else None, prompt, 6)
        assert got.token_ids == tokens, f"adapter {name}: tokens differ from transformers + PEFT"
    with tp_daemon.client() as client:
        engine = client.stats()["engine"]
    assert engine["tensor_parallel_size"] == 2 and engine["alive"]
    assert list(_ranks_of(engine["pid"]).values()) == engine["rank_pids"]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["stats", "--runtime-dir", str(tp_daemon.runtime_dir)]) == 0
    assert "tensor_parallel_size 2" in out.getvalue(), out.getvalue()


def test_a_rank_killed_mid_stream_loses_nothing(tp_daemon):
    """SIGKILL rank 1: rank 0 follows at once, the daemon restarts the whole group and recomputes the
    stream from prompt + streamed tokens; nothing lost, repeated or changed, and the next request runs."""
    prompt = torch.randint(3, 512, (9,)).tolist()
    with tp_daemon.client() as client:
        reference = client.generate(prompt, adapter="odd-r5", max_tokens=30, temperature=0.0, ignore_eos=True,
                                    timeout=120)
        before = client.stats()
        engine_pid = before["engine"]["pid"]
        rank1 = _ranks_of(engine_pid)[1]
        stream = client.stream(prompt, adapter="odd-r5", max_tokens=30, temperature=0.0, ignore_eos=True,
                               timeout=120)
        chunks = []
        started = time.monotonic()
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 4:
                os.kill(rank1, signal.SIGKILL)  # a rank other than 0 dies mid-stream
        result = stream.result
        elapsed = time.monotonic() - started
        after = client.stats()
        again = client.generate(prompt, max_tokens=3, temperature=0.0, ignore_eos=True, timeout=60)
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert result.token_ids == reference.token_ids and result.finish_reason == "length"
    assert after["engine_restarts"] > before["engine_restarts"] and after["engine"]["pid"] != engine_pid
    assert after["engine"]["tensor_parallel_size"] == 2 and rank1 not in after["engine"]["rank_pids"]
    assert len(again.token_ids) == 3
    assert elapsed < 25, f"recovery took {elapsed:.0f} s: a rank waited on the dead one (the timeout is 30 s)"
    assert "tensor-parallel rank 1" in tp_daemon.log()


def test_a_rank_stopped_mid_stream_is_found_within_seconds(tp_daemon):
    """SIGSTOP rank 1 mid-stream: it stops beating, so rank 0 ends the engine within its heartbeat timeout
    (not the 30 s collective timeout, nor the 60 s step deadline), and the daemon restarts the group and
    finishes the stream unchanged."""
    from loraplex.gpu_engine.tp.group import RANK_HEARTBEAT_TIMEOUT_S

    prompt = torch.randint(3, 512, (9,)).tolist()
    with tp_daemon.client() as client:
        reference = client.generate(prompt, adapter="odd-r7-rs", max_tokens=120, temperature=0.0, ignore_eos=True,
                                    timeout=120)
        before = client.stats()
        engine_pid = before["engine"]["pid"]
        rank1 = _ranks_of(engine_pid)[1]
        engine = os.pidfd_open(engine_pid)  # readable once rank 0 has exited
        stream = client.stream(prompt, adapter="odd-r7-rs", max_tokens=120, temperature=0.0, ignore_eos=True,
                               timeout=120)
        chunks, detected = [], None
        try:
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 4:
                    os.kill(rank1, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
                    stopped = time.monotonic()
                    if select.select([engine], [], [], 60)[0]:
                        detected = time.monotonic() - stopped
        finally:
            os.close(engine)
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)  # never leave a stopped process behind a failed test
        result = stream.result
        after = client.stats()
    print(f"stopped rank found after {detected} s")
    assert detected is not None, "rank 0 never went down with its stopped rank"
    assert detected < RANK_HEARTBEAT_TIMEOUT_S + 2.0 <= 5.0, f"a stopped rank was found after {detected:.1f} s"
    assert result.token_ids == reference.token_ids and [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert after["engine_restarts"] > before["engine_restarts"] and after["engine"]["pid"] != engine_pid
    assert "tensor-parallel rank 1" in tp_daemon.log() and "sent no heartbeat" in tp_daemon.log()


@pytest.mark.slow
def test_serve_tp2_with_cpu_assist_matches_peft(demo, adapters, tmp_path):
    """`loraplex serve --tensor-parallel-size 2 --adapter-load-mode cpu_assist`: with adapter loads throttled,
    CPU workers run early layers of cold adapters' prefill through rank 0's exchange (attention and MLP
    targets, the ranks' x slices gathered and the deltas scattered or broadcast); tokens equal PEFT's."""
    from loraplex.ipc.client import AsyncClient
    from tests.hf_reference import greedy

    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    names = ["all-r32", "odd-r5", None, "odd-r3-mlp", "odd-r7-rs"]
    prompts = [p * 3 for p in _prompts(len(names), g)]  # longer prefills so the CPU path has rows to work on
    registered = [f"--adapter={name}={adapters[name]}" for name in ODD]
    proc = DaemonProcess(tmp_path, "--tensor-parallel-size", "2", "--adapter-load-mode", "cpu_assist",
                         "--cpu-workers", "2", *registered,
                         env={"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "3e6"}).start()

    async def run() -> list:
        async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
            return await asyncio.gather(*[client.generate(p, adapter=a, max_tokens=5, temperature=0.0,
                                                          ignore_eos=True, timeout=120)
                                          for p, a in zip(prompts, names)])

    try:
        results = asyncio.run(run())
        with proc.client() as client:
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    for name, prompt, got in zip(names, prompts, results):
        tokens, _ = greedy(demo.model_dir, adapters[name] if name else None, prompt, 5)
        assert got.token_ids == tokens, f"adapter {name}: tokens differ from transformers + PEFT"
    paths = [r.timings["adapter_path"] for r in results]
    assert "cpu_assisted" in paths, (paths, stats.get("cpu_assist"))
    assert stats["load_mode"] == "cpu_assist" and stats["engine"]["tensor_parallel_size"] == 2
    assert stats["cpu_assist"]["jobs"] > 0, stats["cpu_assist"]
