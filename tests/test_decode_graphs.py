"""Decode steps through the CUDA-graph buckets: a batch padded to its bucket gives the
real rows the logits of the unpadded step (heterogeneous ranks, a base row,
shuffled pages), pad rows write only the scratch page that the allocator never
hands out, and whole generations are unchanged. The padding runs eagerly here
(CPU); the capture/replay comparison runs where CUDA is present.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.gpu_engine.decode_graphs import bucket_sizes  # noqa: E402
from loraplex.gpu_engine.demo import llama_config, write_random_adapter, write_random_checkpoint  # noqa: E402
from loraplex.ipc.engine_plan import AdapterPlacement, RowPlan, SamplingSpec, StepPlan  # noqa: E402
from tests.tolerances import assert_within, forward_tolerance

ADAPTERS = {"r4": (4, ["q_proj", "v_proj"]), "r8": (8, ["k_proj", "o_proj", "down_proj"]),
            "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
ROW_ADAPTERS = ["r16", None, "r4", "r8", "r16"]  # five rows: bucket 8, three pad rows
PAGE_TOKENS, NUM_PAGES = 4, 256
GREEDY = SamplingSpec(temperature=0.0, top_p=1.0, top_k=-1, seed=0, logprobs=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("graphs")
    config = llama_config()
    write_random_checkpoint(root / "model", config, seed=int(torch.randint(1 << 16, ())))
    adapters = {}
    for name, (rank, targets) in ADAPTERS.items():
        adapters[name] = root / name
        write_random_adapter(adapters[name], config, rank=rank, alpha=2.0 * rank, target_modules=targets,
                             seed=int(torch.randint(1 << 16, ())))
    return root / "model", adapters


def _llm(model, backend: str, *, pad_eager: bool, **kwargs) -> LLM:
    model_dir, adapters = model
    # float32 (on CUDA the default is bfloat16): padded and unpadded steps within forward_tolerance
    # Triton on a GPU host runs compiled on CUDA: its interpreter is off there, so CPU tensors cannot reach it.
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    llm = LLM(model_dir, lora_backend=backend, page_tokens=PAGE_TOKENS, num_pages=NUM_PAGES, max_num_seqs=8,
              max_lora_rank=32, dtype="float32", device=device, **kwargs)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    if pad_eager:
        llm.executor.setup_decode_graphs(max_batch=8, max_model_len=llm.max_model_len, max_lora_rank=32,
                                         enabled=False, pad_eager=True)
    return llm


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_cpu_engine_reports_eager_decode(model) -> None:
    llm = _llm(model, "torch", pad_eager=False)
    info = llm.executor.graph_info
    assert not info.enabled and info.buckets == () and "cuda" in info.reason.lower()
    assert llm.executor.graphs is None
    assert info.as_dict()["cuda_graphs"] is False
    off = LLM(model[0], page_tokens=PAGE_TOKENS, num_pages=8, cuda_graphs=False).executor.graph_info
    assert not off.enabled and "disabled" in off.reason
    # The scratch page sits past every page the allocator can hand out.
    assert llm.executor.scratch_page == llm.allocator.num_pages == llm.executor.pool.num_pages - 1


def _prefill_then_decode(llm: LLM, seed: int) -> tuple[StepPlan, list[RowPlan]]:
    """Places the adapters and prefills five rows on shuffled pages; returns the decode step's plan
    (rows ordered as the executor orders them)."""
    ex = llm.executor
    rng = random.Random(seed)
    free = list(range(llm.allocator.num_pages))
    rng.shuffle(free)  # non-contiguous pages for every adapter and sequence
    place = [AdapterPlacement(name, [free.pop() for _ in range(ex.host[name].layout.num_pages)])
             for name in ADAPTERS]
    prefill, decode = [], []
    for i, adapter in enumerate(ROW_ADAPTERS):
        prompt = [rng.randrange(3, llm.config.vocab_size) for _ in range(rng.randrange(3, 14))]
        pages = [free.pop() for _ in range(llm.geometry.kv_pages_for(len(prompt) + 1))]
        prefill.append(RowPlan(f"r{i}", prompt, 0, pages, adapter, True, GREEDY))
        decode.append(RowPlan(f"r{i}", [rng.randrange(3, llm.config.vocab_size)], len(prompt), pages, adapter,
                              True, GREEDY, sample_index=1))
    ex.execute(StepPlan(step_id=0, rows=prefill, place=place))
    ordered = sorted(decode, key=lambda r: (r.adapter is not None, r.adapter or ""))
    return StepPlan(step_id=1, rows=decode), ordered


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_bucket_step_matches_unpadded(model, backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    llm = _llm(model, backend, pad_eager=True)
    ex = llm.executor
    assert ex.graphs.static == (backend == "triton"), "triton runs the capture path's static tables and rows"
    plan, ordered = _prefill_then_decode(llm, seed=int(torch.randint(1 << 16, ())))
    want = ex.model.forward(ex._build_batch(ordered, plan), ex.pool)  # unpadded eager step: [5, vocab]
    before = ex.pool.data.clone()
    loras = [ex.resident[r.adapter] if r.adapter else None for r in ordered]
    assert ex.graphs.accepts(ordered, loras)
    got = ex.graphs.run(ordered, loras)
    assert got.shape == want.shape
    tol = forward_tolerance(llm.config)  # logits of two forwards (the K/V of any layer: part of one)
    assert_within(got, want, tol, "logits: ")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Pad rows touched only the scratch page; the real rows rewrote their own slot with the same K/V.
    scratch = ex.scratch_page
    assert_within(ex.pool.data[:, :scratch], before[:, :scratch], tol, "pool: ")
    assert not torch.equal(ex.pool.data[:, scratch], before[:, scratch])


def test_accepts_only_decode_batches_that_fit(model) -> None:
    llm = _llm(model, "torch", pad_eager=True)
    runner = llm.executor.graphs
    assert runner.sizes == (1, 2, 4, 8)
    row = RowPlan("a", [5], 6, [0, 1], None, True, GREEDY)
    assert runner.accepts([row] * 8, [None] * 8)
    assert not runner.accepts([row] * 9, [None] * 9), "larger than the largest bucket"
    assert not runner.accepts([RowPlan("p", [5, 6], 0, [0], None, True, GREEDY)], [None]), "a prefill row"
    assert not runner.accepts([RowPlan("s", [5], 9, [0, 1], None, True, GREEDY)], [None]), "pages too few"


def test_generation_through_padded_buckets_is_unchanged(model) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(1 << 16, ())))
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (5,), generator=g)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    ref = _llm(model, "torch", pad_eager=False).generate(prompts, adapters=ROW_ADAPTERS, sampling=params)
    llm = _llm(model, "torch", pad_eager=True)
    seen: set[int] = set()
    execute = llm.executor.execute

    def recording(plan: StepPlan):
        for row in plan.rows:
            seen.update(row.kv_pages)
        for placement in plan.place:
            seen.update(placement.pages)
        return execute(plan)

    llm.executor.execute = recording
    got = llm.generate(prompts, adapters=ROW_ADAPTERS, sampling=params)
    assert llm.executor.bucket_steps >= 4, "decode steps did not go through the buckets"
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=forward_tolerance(llm.config))
    assert llm.executor.scratch_page not in seen
    assert llm.allocator.usage().by_tag.get("kv", 0) == llm.scheduler.prefix.idle_pages  # only cached prefixes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_like_eager(model) -> None:
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(int(torch.randint(1 << 16, ())))
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (5,), generator=g)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = {}
    for graphs in (False, True):
        llm = _llm(model, "triton", pad_eager=False, device="cuda", cuda_graphs=graphs)
        info = llm.executor.graph_info
        assert info.enabled == graphs
        outs[graphs] = llm.generate(prompts, adapters=ROW_ADAPTERS, sampling=params)
        if graphs:
            assert info.buckets == (1, 2, 4, 8)
            assert llm.executor.graphs.replays >= 6
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=forward_tolerance(llm.config))
