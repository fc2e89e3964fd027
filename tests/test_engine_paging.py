"""Unified paging end to end: pages come back, reused pages give identical results,
and preemption or chunked prefill never change what is generated."""
from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from tests.tolerances import forward_tolerance

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
NAMES = [None, "qv-r8", "all-r32", "mlp-r64", "attn-r16", None]


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(5, 120, (6,), generator=g)]


def _engine(demo, **kwargs) -> LLM:
    llm = LLM(demo.model_dir, **kwargs)
    for name in ("qv-r8", "all-r32", "mlp-r64", "attn-r16"):
        llm.add_adapter(name, demo.adapters[name])
    return llm


@pytest.fixture(scope="module")
def reference(demo):
    llm = _engine(demo, num_pages=512, page_tokens=4)
    prompts = _prompts(11)
    return prompts, llm.generate(prompts, adapters=NAMES, sampling=GREEDY)


def test_pages_return_and_reuse_is_identical(demo, reference):
    prompts, first = reference
    llm = _engine(demo, num_pages=512, page_tokens=4)
    free_before = llm.allocator.num_free
    out1 = llm.generate(prompts, adapters=NAMES, sampling=GREEDY)
    usage = llm.allocator.usage()
    cached = llm.scheduler.prefix.idle_pages  # full pages the prefix cache keeps, held by nobody
    assert usage.by_tag.get("kv", 0) == cached == llm.scheduler.prefix.num_pages, "KV pages leaked"
    adapter_pages = usage.by_tag.get("adapter", 0)
    assert adapter_pages > 0 and usage.free == free_before - adapter_pages - cached
    # Dirty the pool, then run again on reused pages: results must not depend on stale data
    # (the cached prefixes' KV is dirtied too, so they go).
    llm.scheduler.prefix.clear_idle()
    llm.executor.pool.data.normal_()
    for name in list(llm.scheduler.adapters.resident_names()):
        llm.scheduler.adapters.drop(name)
    out2 = llm.generate(prompts, adapters=NAMES, sampling=GREEDY)
    for a, b, c in zip(first, out1, out2):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(c.logprobs, abs=forward_tolerance(llm.config))
    assert llm.allocator.usage().by_tag.get("kv", 0) == llm.scheduler.prefix.idle_pages


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(demo):
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 512, (60,), generator=g).tolist() for _ in range(5)]
    names = ["qv-r8", None, "qv-r8", None, "qv-r8"]
    roomy = _engine(demo, num_pages=512, page_tokens=4)
    expected = roomy.generate(prompts, adapters=names, sampling=GREEDY)
    # The adapter plus two requests' prompts fit; their growth while decoding does not.
    num_pages = roomy._adapter_pages("qv-r8") + 2 * roomy.geometry.kv_pages_for(60) + 1
    llm = LLM(demo.model_dir, num_pages=num_pages, page_tokens=4)
    llm.add_adapter("qv-r8", demo.adapters["qv-r8"])
    out = llm.generate(prompts, adapters=names, sampling=GREEDY)
    assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [o.token_ids for o in expected]
    usage = llm.allocator.usage()
    assert usage.free + usage.by_tag.get("adapter", 0) + llm.scheduler.prefix.idle_pages == num_pages
    assert usage.by_tag.get("kv", 0) == llm.scheduler.prefix.idle_pages

def test_chunked_prefill_gives_the_same_tokens(demo, reference):
    prompts, first = reference
    llm = _engine(demo, num_pages=512, page_tokens=4, max_batched_tokens=16, max_num_seqs=3)
    out = llm.generate(prompts, adapters=NAMES, sampling=GREEDY)
    for a, b in zip(first, out):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=forward_tolerance(llm.config))


def test_stop_tokens_eos_and_max_tokens(demo):
    llm = _engine(demo, num_pages=256)
    prompt = _prompts(3)[0]
    free_run = llm.generate([prompt], sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = free_run.token_ids[4]
    first_hit = free_run.token_ids.index(stop_at)
    stopped = llm.generate([prompt], sampling=SamplingParams(max_tokens=12, temperature=0.0,
                                                              stop_token_ids=(stop_at,)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: first_hit + 1]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12


def test_seeded_sampling_is_reproducible_and_respects_top_k(demo):
    llm = _engine(demo, num_pages=256)
    prompt = _prompts(5)[1]
    params = SamplingParams(max_tokens=16, temperature=1.3, top_k=5, seed=1234, ignore_eos=True, logprobs=True)
    a = llm.generate([prompt, prompt], adapters=["qv-r8", "qv-r8"], sampling=params)
    b = llm.generate([prompt], adapters=["qv-r8"], sampling=params)[0]
    assert a[0].token_ids == a[1].token_ids == b.token_ids
    other = llm.generate([prompt], adapters=["qv-r8"],
                         sampling=SamplingParams(max_tokens=16, temperature=1.3, top_k=5, seed=99, ignore_eos=True))
    assert other[0].token_ids != b.token_ids
    greedy = llm.generate([prompt], sampling=SamplingParams(max_tokens=16, temperature=0.7, top_k=1,
                                                            ignore_eos=True))[0]
    exact = llm.generate([prompt], sampling=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert greedy.token_ids == exact.token_ids


def test_text_prompts_and_text_output(demo):
    llm = _engine(demo, num_pages=128)
    out = llm.generate(["The river runs", "A small house"], adapters=["attn-r16", None],
                       sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for o in out:
        assert len(o.token_ids) == 8
        assert o.text == llm.decode(o.token_ids)
        assert o.prompt_token_ids == llm.encode(o.prompt_token_ids) or o.prompt_token_ids


def test_bfloat16_runs_close_to_float32(demo, reference):
    prompts, first = reference
    llm = _engine(demo, num_pages=256, dtype="bfloat16")
    out = llm.generate(prompts[:2], adapters=NAMES[:2], sampling=SamplingParams(max_tokens=4, temperature=0.0,
                                                                                ignore_eos=True, logprobs=True))
    for a, b in zip(first, out):
        assert a.token_ids[0] == b.token_ids[0]
        assert abs(a.logprobs[0] - b.logprobs[0]) < 0.2


def test_layer_group_loading_waits_per_group_and_changes_nothing(demo, reference):
    prompts, first = reference
    # ~2 MB/s: the rank-32/64 adapters take a noticeable time, spread over 4 groups of one layer each.
    llm = _engine(demo, num_pages=512, page_tokens=4, load_groups=4, load_throttle_bytes_s=8e6)
    out = llm.generate(prompts, adapters=NAMES, sampling=GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in first]
    assert llm.load_wait_ms > 0, "throttled loads should have made compute wait on layer groups"
    assert not llm.executor.loads, "finished loads are forgotten"


def test_admitting_when_loaded_waits_in_the_queue_not_in_the_step(demo, reference):
    """The engine reports loads still arriving after each step; with admit_when_loaded a request
    whose adapter is on its way stays queued while the others run, with the same tokens."""
    prompts, first = reference
    llm = _engine(demo, num_pages=512, page_tokens=4, load_groups=4, load_throttle_bytes_s=8e6,
                  admit_when_loaded=True)
    reported: list[list[str]] = []
    execute = llm.executor.execute

    def recording(plan):
        result = execute(plan)
        reported.append(list(result.loading))
        return result

    llm.executor.execute = recording
    seqs = []
    add = llm.scheduler.add
    llm.scheduler.add = lambda req: seqs.append(add(req)) or seqs[-1]
    out = llm.generate(prompts, adapters=NAMES, sampling=GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in first]
    assert any(reported), "throttled loads should still be arriving after some step"
    assert not reported[-1] and not llm.executor.loads
    waited = [s for s in seqs if s.waited_for_adapter]
    # The base-model request runs from the first step, so every adapter request waited for its copy.
    assert waited == [s for s in seqs if s.req.adapter is not None]
