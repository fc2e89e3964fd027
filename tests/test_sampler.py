"""The sampler's logits processing and top logprobs against a plain torch reference
of the same logits: logit_bias, min_tokens, repetition/frequency/presence penalties,
greedy and seeded rows, with and without options mixed in one batch."""
from __future__ import annotations

import math
import random

import pytest
import torch

from loraplex.gpu_engine.sampler import Sampler, _filtered_probs, stream_seed
from loraplex.gpu_engine.sampling_history import SamplingHistory
from loraplex.ipc.engine_plan import RowPlan, SamplingSpec
from tests.tolerances import gamma, unit_roundoff

VOCAB = 64
EOS = (3,)


def _row(rid: str, tokens: list[int], start: int, spec: SamplingSpec, sample: bool, index: int) -> RowPlan:
    return RowPlan(request_id=rid, token_ids=tokens, start_pos=start, kv_pages=[0], adapter=None, sample=sample,
                   sampling=spec, sample_index=index)


def _reference(logits: torch.Tensor, spec: SamplingSpec, prompt: list[int], output: list[int],
               eos: tuple[int, ...] = EOS) -> torch.Tensor:
    """Element by element, as vLLM documents each option."""
    x = [float(v) for v in logits]
    for t, b in zip(spec.logit_bias_ids, spec.logit_bias_values):
        x[t] += b
    if len(output) < spec.min_tokens:
        for t in list(spec.stop_token_ids) + ([] if spec.ignore_eos else list(eos)):
            x[t] = -math.inf
    for t in set(prompt) | set(output):
        x[t] = x[t] / spec.repetition_penalty if x[t] > 0 else x[t] * spec.repetition_penalty
    for t in set(output):
        x[t] -= spec.frequency_penalty * output.count(t) + spec.presence_penalty
    return torch.tensor(x, dtype=torch.float32)


def _random_spec(rng: random.Random, plain: bool) -> SamplingSpec:
    seed = rng.getrandbits(63)
    temperature = rng.choice((0.0, 0.7, 1.3))
    if plain:
        return SamplingSpec(temperature=temperature, seed=seed, logprobs=rng.random() < 0.5)
    bias = rng.sample(range(VOCAB), rng.randint(0, 5))
    return SamplingSpec(
        temperature=temperature, seed=seed, top_k=rng.choice((-1, 20)), top_p=rng.choice((1.0, 0.9)),
        top_logprobs=rng.randint(0, 20), presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
        repetition_penalty=rng.choice((1.0, rng.uniform(0.5, 2.0))), logit_bias_ids=bias,
        logit_bias_values=[rng.uniform(-100, 100) for _ in bias], min_tokens=rng.randint(0, 6),
        stop_token_ids=rng.sample(range(VOCAB), 2), ignore_eos=rng.random() < 0.3)


@pytest.mark.parametrize("trial", range(6))
def test_processing_and_top_logprobs_match_a_torch_reference(trial: int) -> None:
    rng = random.Random(1000 + trial)
    torch.manual_seed(trial)
    sampler = Sampler(VOCAB, EOS)
    rows, expected = [], []
    for r in range(8):
        spec = _random_spec(rng, plain=r % 3 == 0)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))]
        rid = f"r{r}"
        # The prompt as a chunked prefill in an earlier step, then prompt tail + output in this one.
        cut = rng.randint(0, len(prompt) - 1)
        if cut:
            sampler.sample(torch.zeros(0, VOCAB), [_row(rid, prompt[:cut], 0, spec, False, 0)], [])
        context = prompt + output
        rows.append(_row(rid, context[cut:], cut, spec, True, len(output)))
        expected.append((spec, prompt, output))
    logits = torch.randn(len(rows), VOCAB) * 3
    results = sampler.sample(logits, rows, rows)
    raw = torch.log_softmax(logits, dim=-1)
    # log_softmax over VOCAB terms in float32, twice: the sum's bound, and a few roundings of the largest logit
    tol = [2 * (gamma(VOCAB, torch.float32) + 4 * unit_roundoff(torch.float32) * float(row.abs().max()))
           for row in logits]
    for i, ((spec, prompt, output), res) in enumerate(zip(expected, results)):
        ref = _reference(logits[i], spec, prompt, output)
        if spec.temperature == 0.0:
            want = int(torch.argmax(ref))
        else:
            gen = torch.Generator().manual_seed(stream_seed(spec.seed, len(output)))
            want = int(torch.multinomial(_filtered_probs(ref, spec), 1, generator=gen))
        assert res.token_id == want, (i, spec)
        if spec.logprobs or spec.top_logprobs:
            assert res.logprob == pytest.approx(float(raw[i, want]), abs=tol[i])
        else:
            assert res.logprob is None
        order = torch.argsort(raw[i], descending=True)[: spec.top_logprobs]
        assert res.top_ids == order.tolist()
        assert res.top_logprobs == pytest.approx(raw[i, order].tolist(), abs=tol[i])
        if len(output) < spec.min_tokens:
            assert res.token_id not in spec.stop_token_ids
            assert spec.ignore_eos or res.token_id not in EOS


def test_plain_rows_are_unchanged_by_processed_neighbours() -> None:
    """A row without options samples what it would alone, whatever its batch neighbours ask for."""
    torch.manual_seed(7)
    logits = torch.randn(3, VOCAB)
    plain = SamplingSpec(temperature=0.8, seed=5)
    heavy = SamplingSpec(temperature=0.0, presence_penalty=2.0, repetition_penalty=1.7, logit_bias_ids=[1],
                         logit_bias_values=[100.0], top_logprobs=20)
    rows = [_row("a", [1, 2, 3], 0, plain, True, 0), _row("b", [1, 1, 4], 0, heavy, True, 0),
            _row("c", [9], 0, plain, True, 0)]
    together = Sampler(VOCAB, EOS).sample(logits, rows, rows)
    for i in (0, 2):
        alone = Sampler(VOCAB, EOS).sample(logits[i:i + 1], [rows[i]], [rows[i]])[0]
        assert together[i] == alone
    assert together[1].token_id == 1  # the +100 bias wins over the repetition penalty


def test_history_follows_recompute_and_refuses_gaps() -> None:
    history = SamplingHistory(max_requests=2)
    spec = SamplingSpec(frequency_penalty=1.0)
    history.feed(_row("a", [5, 6, 7], 0, spec, True, 0))
    history.feed(_row("a", [8], 3, spec, True, 1))
    assert list(history.split(_row("a", [8], 3, spec, True, 1))[0]) == [5, 6, 7, 8]
    history.feed(_row("a", [5, 6, 7, 8], 0, spec, True, 1))  # recomputed after preemption: starts over
    context, out_start = history.split(_row("a", [5, 6, 7, 8], 0, spec, True, 1))
    assert list(context[out_start:]) == [8]
    with pytest.raises(ValueError, match="never saw"):
        history.feed(_row("b", [1], 4, spec, True, 0))
    with pytest.raises(ValueError, match="after only"):
        history.feed(_row("a", [1], 9, spec, True, 2))
    history.feed(_row("b", [1], 0, spec, True, 0))
    history.feed(_row("c", [1], 0, spec, True, 0))
    assert len(history) == 2  # bounded: the least recently fed ("a") went


@pytest.mark.parametrize("kwargs", [{"top_logprobs": 21}, {"presence_penalty": 2.5}, {"repetition_penalty": 0.0},
                                    {"logit_bias_ids": [1], "logit_bias_values": []},
                                    {"logit_bias_ids": [1], "logit_bias_values": [101.0]}, {"min_tokens": -1}])
def test_spec_bounds(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingSpec(**kwargs)
