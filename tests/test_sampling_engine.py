"""Sampling options through the real engine (offline LLM on the demo model): rows with
penalties, logit_bias, min_tokens and top_logprobs share batches with plain rows and
different adapters, under chunked prefill and preemption; each processed token is
checked against the torch reference of the logits that step produced."""
from __future__ import annotations

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.gpu_engine.sampler import _filtered_probs, stream_seed
from tests.test_sampler import _reference
from tests.tolerances import assert_within, forward_tolerance, reduction_bound

NAMES = ["qv-r8", None, "all-r32", "qv-r8", None, "all-r32"]


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(20, 70, (6,), generator=g)]


def _params(i: int, plain: bool) -> SamplingParams:
    if plain:
        return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    return SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, seed=100 + i, top_logprobs=3 + i,
                          presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3 + 0.1 * i,
                          logit_bias={7: 4.0, 9: -50.0}, min_tokens=4, stop_token_ids=(11,))


def _engine(demo, **kwargs) -> LLM:
    llm = LLM(demo.model_dir, page_tokens=4, **kwargs)
    for name in ("qv-r8", "all-r32"):
        llm.add_adapter(name, demo.adapters[name])
    return llm


def _recording(llm: LLM) -> list[tuple[torch.Tensor, list, dict[int, torch.Tensor]]]:
    """Each step's logits, sampled rows and the sampler's processed logits of the processed rows."""
    seen: list[tuple[torch.Tensor, list, dict[int, torch.Tensor]]] = []
    sampler = llm.executor.sampler
    real = sampler.sample

    def sample(logits, rows, sampled):
        results = real(logits, rows, sampled)  # feeds the history first
        processed = {j: sampler._process(logits[j], row) for j, row in enumerate(sampled)
                     if row.sampling.processes_logits}
        seen.append((logits.clone(), list(sampled), processed))
        return results

    llm.executor.sampler.sample = sample  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def plain_alone(demo):
    """The plain rows' tokens from a batch in which no row asks for any option."""
    llm = _engine(demo, num_pages=512)
    return llm.generate(_prompts(5), adapters=NAMES, sampling=[_params(i, True) for i in range(6)])


@pytest.mark.parametrize("kwargs", [{"num_pages": 512}, {"num_pages": 512, "max_batched_tokens": 48},
                                    {"num_pages": 0}])
def test_processed_rows_match_the_reference_and_plain_rows_are_untouched(demo, plain_alone, kwargs):
    if not kwargs["num_pages"]:  # both adapters plus two requests' KV: decoding six preempts
        roomy = _engine(demo, num_pages=512)
        pages = roomy._adapter_pages("qv-r8") + roomy._adapter_pages("all-r32") + 2 * roomy.geometry.kv_pages_for(82)
        kwargs = {"num_pages": pages + 1}
    llm = _engine(demo, **kwargs)
    seen = _recording(llm)
    prompts = _prompts(5)
    params = [_params(i, plain=i % 3 == 0) for i in range(6)]
    out = llm.generate(prompts, adapters=NAMES, sampling=params)
    if kwargs["num_pages"] < 512:
        assert llm.scheduler.num_preemptions > 0
    for i in (0, 3):  # the plain rows: exactly what they produce beside other plain rows
        assert out[i].token_ids == plain_alone[i].token_ids
        assert out[i].logprobs == pytest.approx(plain_alone[i].logprobs, abs=forward_tolerance(llm.config))
    by_id = {o.request_id: (p, prompt, o) for p, prompt, o in zip(params, prompts, out)}
    checked = 0
    for logits, rows, processed in seen:
        for j, row in enumerate(rows):
            params_i, prompt, o = by_id[row.request_id]
            if not row.sampling.processes_logits:
                continue
            k = row.sample_index
            ref = _reference(logits[j], row.sampling, prompt, o.token_ids[:k], llm.config.eos_token_ids)
            spec = row.sampling
            # each processed logit: a few float32 operations (bias, repetition penalty, the two penalties)
            # on values no larger than this
            scale = (float(logits[j].abs().max()) + max(map(abs, spec.logit_bias_values), default=0.0)
                     + abs(spec.frequency_penalty) * k + abs(spec.presence_penalty)) * max(spec.repetition_penalty, 1.0)
            assert_within(processed[j], ref, reduction_bound(torch.tensor(scale), 4, torch.float32),
                          f"{row.request_id} token {k}: ")
            if row.sampling.temperature == 0.0:
                assert o.token_ids[k] == int(torch.argmax(ref))
            else:
                gen = torch.Generator().manual_seed(stream_seed(row.sampling.seed, k))
                assert o.token_ids[k] == int(torch.multinomial(_filtered_probs(ref, row.sampling), 1, generator=gen))
            checked += 1
    assert checked >= 4 * 12
    for p, o in zip(params, out):
        if p.top_logprobs:
            assert len(o.top_logprobs) == len(o.token_ids)
            assert all(len(alt) == p.top_logprobs for alt in o.top_logprobs)
            assert 11 not in o.token_ids[:4] and not set(llm.config.eos_token_ids) & set(o.token_ids[:4])
