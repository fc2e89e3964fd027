"""One row's numbers never fail the others: temperatures below the floor sample greedily; a row
whose logits hold NaN or +inf, or whose options mask every token, fails alone with
`sampling_error`; a row whose sampling or forward raises is found by running the rest in halves
(gpu_engine/row_isolation.py) and fails alone; a step that fails for every subset still raises.
Fresh random logits each run (the seed is in every failure message)."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from loraplex.gateway.errors import from_daemon
from loraplex.gpu_engine.row_isolation import bisect_failures, isolate_step
from loraplex.gpu_engine.sampler import Sampler, _filtered_probs, stream_seed
from loraplex.ipc.engine_plan import SAMPLING_EPS, AdapterPlacement, RowResult, SamplingSpec, StepPlan, StepResult
from loraplex.ipc.errors import ErrorCode, LoraplexError
from tests.test_fcfs_scheduler import FakeEngine, assert_drained, make, request
from tests.test_sampler import _row

VOCAB = 64
EOS = (3,)
SAMPLING_ERROR = ErrorCode.SAMPLING_ERROR.value


def _fresh() -> tuple[random.Random, torch.Generator, int]:
    seed = random.SystemRandom().getrandbits(32)
    return random.Random(seed), torch.Generator().manual_seed(seed), seed


def _rows(specs: list[SamplingSpec], rng: random.Random):
    """One decode row per spec, each with a short random prompt as its context."""
    rows = []
    for i, spec in enumerate(specs):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 6))]
        rows.append(_row(f"r{i}", prompt, 0, spec, True, 0))
    return rows


def _sample_alone(logits: torch.Tensor, rows, keep: list[int]) -> dict[str, RowResult]:
    """The results of the `keep` rows sampled in a batch of their own (a fresh sampler)."""
    sub = [rows[i] for i in keep]
    return {r.request_id: r for r in Sampler(VOCAB, EOS).sample(logits[keep], sub, sub)}


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-10, SAMPLING_EPS / 2])
def test_temperatures_below_the_floor_sample_greedily(temperature: float) -> None:
    rng, gen, seed = _fresh()
    specs = [SamplingSpec(temperature=temperature, seed=rng.getrandbits(63), logprobs=True,
                          top_k=rng.choice((-1, 7)), top_p=rng.choice((1.0, 0.5))) for _ in range(3)]
    specs += [SamplingSpec(temperature=0.8, seed=rng.getrandbits(63)), SamplingSpec(temperature=0.0)]
    rows = _rows(specs, rng)
    logits = torch.randn(len(rows), VOCAB, generator=gen) * 5
    results = Sampler(VOCAB, EOS).sample(logits, rows, rows)
    for i, res in enumerate(results):
        assert res.error == "", (seed, res.error)
        if specs[i].temperature < 0.5:
            assert res.token_id == int(torch.argmax(logits[i])), seed
        else:  # a sampled neighbour draws what it draws alone
            probs = _filtered_probs(logits[i], specs[i])
            draw = torch.Generator().manual_seed(stream_seed(specs[i].seed, 0))
            assert res.token_id == int(torch.multinomial(probs, 1, generator=draw)), seed
    assert all(math.isfinite(r.logprob) for r in results[:3])


def test_the_floor_itself_samples_with_finite_probabilities() -> None:
    rng, gen, seed = _fresh()
    spec = SamplingSpec(temperature=SAMPLING_EPS, seed=rng.getrandbits(63))
    logits = torch.randn(1, VOCAB, generator=gen) * 100  # logit gaps / 1e-5: far past exp's range, still finite
    assert torch.isfinite(_filtered_probs(logits[0], spec)).all(), seed
    [res] = Sampler(VOCAB, EOS).sample(logits, _rows([spec], rng), _rows([spec], rng))
    assert res.error == "" and res.token_id == int(torch.argmax(logits[0])), seed


@pytest.mark.parametrize("bad", ["nan", "posinf", "repetition_penalty"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_row_with_non_finite_logits_fails_alone(bad: str, temperature: float) -> None:
    rng, gen, seed = _fresh()
    n = rng.randint(3, 8)
    specs = [SamplingSpec(temperature=rng.choice((0.0, 1e-45, 0.7)), seed=rng.getrandbits(63),
                          top_logprobs=rng.randint(0, 3)) for _ in range(n)]
    victim = rng.randrange(n)
    logits = torch.randn(n, VOCAB, generator=gen) * 3
    if bad == "repetition_penalty":  # a seen token's positive logit divided by ~0: +inf, through the public API
        specs[victim] = SamplingSpec(temperature=temperature, seed=1, repetition_penalty=1e-45)
        rows = _rows(specs, rng)
        logits[victim, rows[victim].token_ids[0]] = abs(float(logits[victim, 0])) + 1.0
    else:
        specs[victim] = SamplingSpec(temperature=temperature, seed=1, logprobs=True)
        rows = _rows(specs, rng)
        logits[victim, rng.randrange(VOCAB)] = math.nan if bad == "nan" else math.inf
    results = Sampler(VOCAB, EOS).sample(logits, rows, rows)
    assert results[victim].error_code == SAMPLING_ERROR, (seed, results[victim])
    assert "NaN or +inf" in results[victim].error and results[victim].logprob is None
    alone = _sample_alone(logits, rows, [i for i in range(n) if i != victim])
    for i, res in enumerate(results):
        if i != victim:
            assert res == alone[res.request_id], seed


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_row_whose_options_mask_every_token_fails_alone(temperature: float) -> None:
    rng, gen, seed = _fresh()
    masked = SamplingSpec(temperature=temperature, min_tokens=2, stop_token_ids=list(range(VOCAB)), seed=5)
    specs = [SamplingSpec(temperature=0.7, seed=rng.getrandbits(63)), masked, SamplingSpec(temperature=0.0)]
    rows = _rows(specs, rng)
    logits = torch.randn(3, VOCAB, generator=gen)
    results = Sampler(VOCAB, EOS).sample(logits, rows, rows)
    assert (results[1].error_code, results[1].error) == (
        SAMPLING_ERROR, "no token is allowed: min_tokens, stop_token_ids and logit_bias mask the whole vocabulary")
    alone = _sample_alone(logits, rows, [0, 2])
    assert [results[0], results[2]] == [alone["r0"], alone["r2"]], seed


def test_a_row_whose_sampling_raises_fails_alone_and_all_raising_raises(monkeypatch) -> None:
    rng, gen, seed = _fresh()
    n = rng.randint(2, 9)
    specs = [SamplingSpec(temperature=rng.choice((0.0, 0.8)), seed=rng.getrandbits(63), logit_bias_ids=[5],
                          logit_bias_values=[rng.uniform(-3, 3)]) for _ in range(n)]
    rows = _rows(specs, rng)
    logits = torch.randn(n, VOCAB, generator=gen)
    sampler = Sampler(VOCAB, EOS)
    real = sampler._process
    # up to bit_length(n) - 1 rows: as many as bisection always finds before it would give up
    poisoned = {rows[i].request_id for i in rng.sample(range(n), rng.randint(1, n.bit_length() - 1))}

    def process(row_logits, row):
        if row.request_id in poisoned:
            raise IndexError("a bug in one row's options")
        return real(row_logits, row)

    monkeypatch.setattr(sampler, "_process", process)
    results = sampler.sample(logits, rows, rows)
    assert [r.request_id for r in results] == [r.request_id for r in rows]
    alone = _sample_alone(logits, rows, [i for i, r in enumerate(rows) if r.request_id not in poisoned])
    for res in results:
        if res.request_id in poisoned:
            assert res.error_code == SAMPLING_ERROR and "a bug in one row's options" in res.error, seed
        else:
            assert res == alone[res.request_id], seed
    poisoned = {r.request_id for r in rows}  # every row raises: the sampler's failure, not a row's
    with pytest.raises(IndexError):
        sampler.sample(logits, rows, rows)
    with pytest.raises(IndexError):  # a lone row cannot be told from a broken sampler
        sampler.sample(logits[:1], rows[:1], rows[:1])


# ---- bisection ------------------------------------------------------------------------------------

@pytest.mark.parametrize("trial", range(4))
def test_bisection_finds_exactly_the_rows_that_fail_alone(trial: int) -> None:
    rng, _, seed = _fresh()
    n = rng.randint(2, 200)
    guilty = set(rng.sample(range(n), rng.randint(1, n.bit_length() - 1)))
    runs: list[list[int]] = []

    def run(part: list[int]) -> list[int]:
        runs.append(part)
        if guilty & set(part):
            raise ValueError(f"rows {sorted(guilty & set(part))}")
        return part

    results, found = bisect_failures(run, list(range(n)), ValueError("the whole step"))
    assert sorted(i for part in results for i in part) == sorted(set(range(n)) - guilty), seed
    assert {i for i, _ in found} == guilty and all(str(exc) == f"rows [{i}]" for i, exc in found), seed
    assert len(runs) <= 2 * len(guilty) * n.bit_length() + len(guilty) + 2, (seed, len(runs))


def test_bisection_blames_nobody_for_a_fault_that_passes() -> None:
    """The whole engine fails a few runs, then recovers: every row is served, none is blamed."""
    rng, _, seed = _fresh()
    n = rng.randint(3, 100)  # two rows whose both halves fail: every run failed, the step fails (above)
    failing = rng.randint(1, n.bit_length())  # runs after the step's own that fail whatever they hold
    runs = []

    def run(part):
        runs.append(part)
        if len(runs) <= failing:
            raise RuntimeError("the engine hiccuped")
        return part

    results, found = bisect_failures(run, list(range(n)), RuntimeError("step"))
    assert found == [] and sorted(i for part in results for i in part) == list(range(n)), seed


def test_bisection_blames_nothing_when_every_subset_fails() -> None:
    rng, _, seed = _fresh()
    n = rng.randint(2, 300)
    runs = []
    original = RuntimeError("CUDA error: an illegal memory access was encountered")

    def run(part):
        runs.append(part)
        raise RuntimeError("the engine is broken")

    with pytest.raises(RuntimeError) as info:
        bisect_failures(run, list(range(n)), original)
    assert info.value is original and len(runs) <= 2 * n.bit_length(), (seed, len(runs))
    with pytest.raises(RuntimeError) as info:  # one row: nothing to compare it with
        bisect_failures(lambda part: part, [0], original)
    assert info.value is original and len(runs) <= 2 * n.bit_length()


def test_bisection_never_swallows_out_of_memory() -> None:
    def run(part):
        if len(part) < 4:
            raise MemoryError("out of memory")
        raise ValueError("bad row")

    with pytest.raises(MemoryError):
        bisect_failures(run, list(range(8)), ValueError("step"), (MemoryError,))


def test_isolated_step_reports_the_guilty_rows_and_keeps_the_rest() -> None:
    rng, _, seed = _fresh()
    n = rng.randint(2, 12)
    rows = [_row(f"q{i}", [rng.randrange(VOCAB)], 0, SamplingSpec(), rng.random() < 0.7, 0) for i in range(n)]
    guilty = rng.choice(rows).request_id
    plan = StepPlan(step_id=9, rows=rows, place=[AdapterPlacement("a", [1, 2])], evict=["b"])
    seen: list[StepPlan] = []

    def execute(sub: StepPlan) -> StepResult:
        seen.append(sub)
        if any(r.request_id == guilty for r in sub.rows):
            raise RuntimeError("index out of range in the forward")
        return StepResult(step_id=sub.step_id, rows=[RowResult(r.request_id, 7, None) for r in sub.rows if r.sample],
                          forward_ms=1.0, transfer_bytes={"adapter_h2d": 10})

    for placed in (True, False):
        seen.clear()
        result = isolate_step(execute, plan, RuntimeError("step"), placed=placed)
        assert all((s.place, s.evict) == (([], []) if placed else (plan.place, plan.evict)) for s in seen)
        by_id = {r.request_id: r for r in result.rows}
        assert by_id.pop(guilty).error_code == ErrorCode.ENGINE_FAILED.value, seed
        assert by_id == {r.request_id: RowResult(r.request_id, 7, None) for r in rows if r.sample
                         and r.request_id != guilty}, seed
        ok = [s for s in seen if all(r.request_id != guilty for r in s.rows)]
        assert result.forward_ms == len(ok) and result.transfer_bytes == {"adapter_h2d": 10 * len(ok)}


def test_engine_orders_isolate_a_row_whose_forward_raises(demo) -> None:
    """Through the real executor on the demo model: a row whose forward raises (the test-only
    token_raise fault) fails alone with engine_failed and the others' tokens are those of the
    step without it; a step whose every row raises, or a lone row, still fails the step."""
    from loraplex.contracts.engine_spec import EngineSpec
    from loraplex.gpu_engine.engine_orders import EngineOrders
    from loraplex.gpu_engine.faults import install_faults
    from loraplex.gpu_engine.runtime import build_runtime
    from loraplex.ipc.engine_plan import RowPlan
    from loraplex.ipc.protocol import EngineFailure, EngineStepDone

    rng, _, seed = _fresh()
    orders = EngineOrders(build_runtime(EngineSpec(model=str(demo.model_dir), device="cpu", num_pages=64)))
    geometry, next_page = orders.runtime.geometry, 0

    def row(rid: str, prompt: list[int]) -> RowPlan:
        nonlocal next_page
        n = geometry.kv_pages_for(len(prompt) + 1)
        next_page += n
        return RowPlan(rid, prompt, 0, list(range(next_page - n, next_page)), None, True, SamplingSpec(temperature=0.0))

    poison = rng.randrange(3, 500)
    prompts = [[t for t in (rng.randrange(3, 500) for _ in range(rng.randint(2, 9))) if t != poison] or [5]
               for _ in range(rng.randint(2, 5))]
    healthy = [row(f"h{i}", p) for i, p in enumerate(prompts)]
    bad = [row(f"b{i}", [rng.randrange(3, 500), poison]) for i in range(2)]
    clean = orders.step(StepPlan(1, healthy))
    assert isinstance(clean, EngineStepDone)
    install_faults(orders.runtime.executor.model, {"LORAPLEX_FAULTS": f"token_raise={poison}"})
    mixed = healthy + bad[:1]
    rng.shuffle(mixed)
    reply = orders.step(StepPlan(2, mixed))
    assert isinstance(reply, EngineStepDone), (seed, reply)
    by_id = {r.request_id: r for r in reply.result.rows}
    assert by_id.pop("b0").error_code == ErrorCode.ENGINE_FAILED.value, seed
    assert by_id == {r.request_id: r for r in clean.result.rows}, seed
    for plan in (StepPlan(3, bad), StepPlan(4, bad[:1])):
        failed = orders.step(plan)
        assert isinstance(failed, EngineFailure) and failed.code == ErrorCode.ENGINE_FAILED.value, (seed, failed)
    orders.close()


# ---- the daemon's side ----------------------------------------------------------------------------

def test_a_failed_prefill_row_finishes_its_request_and_caches_nothing() -> None:
    """A row that does not sample but failed on the engine (its KV may not be written) fails its
    request at once: its pages never reach the prefix cache; the other request is untouched."""
    rng, _, seed = _fresh()
    prompt = [rng.randrange(4, 40) for _ in range(30)]
    other = [rng.randrange(4, 40) for _ in range(5)]

    class FailingEngine(FakeEngine):
        def execute(self, plan: StepPlan) -> StepResult:
            result = super().execute(plan)
            failed = [RowResult("bad", 0, None, error="boom", error_code=ErrorCode.ENGINE_FAILED.value)
                      for r in plan.rows if r.request_id == "bad"]
            return dataclasses.replace(result, rows=[r for r in result.rows if r.request_id != "bad"] + failed)

    sched = make(200, max_batched_tokens=8, prefix_cache=True)
    engine = FailingEngine(sched)
    bad, good = engine.add(request("bad", prompt, 4)), engine.add(request("good", other, 6))
    finished = engine.run()
    assert (bad.finish_reason, bad.output_ids) == ("error", []), seed
    assert good.finish_reason == "length" and len(good.output_ids) == 6
    assert {s.request_id for s in finished} == {"bad", "good"}
    assert sched.prefix.peek(None, prompt) == 0, "pages of the failed prefill were cached"
    assert_drained(sched)


def test_sampling_error_is_a_400_through_the_gateway() -> None:
    err = from_daemon(LoraplexError(ErrorCode.SAMPLING_ERROR, "the logits of this request hold NaN or +inf"))
    assert (err.status, err.code, err.body()["error"]["type"]) == (400, "sampling_error", "invalid_request_error")
    assert ErrorCode.parse("sampling_error") is ErrorCode.SAMPLING_ERROR
