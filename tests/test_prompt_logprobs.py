"""Prompt logprobs (vLLM's prompt_logprobs) in process: the chunked scoring against a one-pass
float64 reference, which positions a chunked prefill scores, the daemon's book of chunks, the
wire round trip, the prefix cache never serving them stale, and the engine (offline API: the
daemon's scheduler over the executor) against transformers + PEFT in float64, in mixed batches
of adapters with chunked prefill."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.daemon.prompt_logprobs import PromptLogprobBook, check_prompt_logprobs
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.scheduler.plan_draft import prompt_scoring
from loraplex.daemon.scheduler.prefix_reuse import reuses_prefix
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence
from loraplex.gpu_engine import prompt_logprobs as scoring
from loraplex.ipc import codec
from loraplex.ipc.engine_plan import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    PromptLogprobChunk,
    RowPlan,
    SamplingSpec,
    StepPlan,
    StepResult,
)
from loraplex.ipc.plan_delta import PlanBook, PlanEncoder
from loraplex.ipc.protocol import EngineStepDelta, EngineStepDone, GenerateRequest
from tests.hf_reference import prompt_logprobs as reference
from tests.tolerances import forward_tolerance

EPS32 = torch.finfo(torch.float32).eps


def _fresh_seed() -> int:
    """Fresh inputs each run; the seed is in every failure message, to replay it."""
    return int.from_bytes(os.urandom(4), "little")


# ---- the chunked scoring ------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, None])
def test_chunked_scoring_equals_one_pass(chunk_rows):
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    vocab, hidden, k = 97, 24, 5
    weight = torch.randn(vocab, hidden, generator=g)
    states = torch.randn(23, hidden, generator=g)
    targets = torch.randint(0, vocab, (23,), generator=g)
    rows = [scoring.ScoredRow("a", 0, 10, 0, k), scoring.ScoredRow("b", 10, 1, 40, 0),
            scoring.ScoredRow("c", 11, 12, 7, 2)]
    calls: list[int] = []

    def logits_of(h: torch.Tensor, start: int) -> torch.Tensor:
        assert torch.equal(h, states[start:start + h.shape[0]])  # each chunk says where it starts
        calls.append(h.shape[0])
        return h @ weight.T

    out = scoring.score(logits_of, states, targets, rows, vocab, chunk_rows=chunk_rows)
    ref = torch.log_softmax(states.double() @ weight.double().T, dim=-1)  # [23, vocab]
    # float32 logits of a `hidden`-long dot product, then log_softmax: a few ulps times the reduction
    tol = 4 * EPS32 * hidden * float(ref.abs().max())
    assert [c.request_id for c in out] == ["a", "b", "c"]
    assert [c.first for c in out] == [1, 41, 8]
    at = 0
    for chunk, row in zip(out, rows):
        for j, (lp, rank) in enumerate(zip(chunk.logprobs, chunk.ranks)):
            want = ref[at + j]
            target = int(targets[at + j])
            assert abs(lp - float(want[target])) < tol, f"seed {seed}"
            # 1 + the tokens above the target: exact, but for those within the tolerance of it
            lower, upper = 1 + int((want > want[target] + tol).sum()), 1 + int((want > want[target] - tol).sum())
            assert lower <= rank <= upper, f"seed {seed}"
        assert len(chunk.top_ids) == (row.count if row.k else 0)
        for j, (ids, lps) in enumerate(zip(chunk.top_ids, chunk.top_logprobs)):
            want_lps, _ = torch.topk(ref[at + j], row.k)
            assert len(ids) == row.k
            assert max(abs(a - float(b)) for a, b in zip(lps, want_lps)) < tol, f"seed {seed}"
            assert all(abs(float(ref[at + j][i]) - lp) < tol for i, lp in zip(ids, lps)), f"seed {seed}"
        at += row.count
    step = chunk_rows or max(1, scoring.MAX_CHUNK_ELEMS // vocab)
    assert max(calls) <= step and sum(calls) == 23


def test_default_chunk_bounds_the_logits_held():
    vocab = 1 << 15
    rows = scoring.MAX_CHUNK_ELEMS // vocab
    states = torch.zeros(3 * rows + 5, 4)
    seen: list[int] = []

    def logits_of(h: torch.Tensor, start: int) -> torch.Tensor:
        seen.append(h.shape[0])
        return torch.zeros(h.shape[0], vocab)

    out = scoring.score(logits_of, states, torch.zeros(states.shape[0], dtype=torch.int64),
                        [scoring.ScoredRow("r", 0, states.shape[0], 0, 0)], vocab)
    assert seen == [rows, rows, rows, 5]
    assert out[0].ranks == [1] * states.shape[0]  # every logit ties: nothing is above the target
    assert max(seen) * vocab <= scoring.MAX_CHUNK_ELEMS


def test_a_rank_without_logits_scores_nothing_but_joins_every_chunk():
    calls = []
    out = scoring.score(lambda h, start: calls.append(h.shape[0]), torch.zeros(10, 4),
                        torch.zeros(10, dtype=torch.int64),
                        [scoring.ScoredRow("r", 0, 10, 0, 3)], 8, chunk_rows=4)
    assert out == [] and calls == [4, 4, 2]


def test_non_finite_logprobs_are_floored():
    logits = torch.tensor([[0.0, float("nan")], [0.0, float("-inf")]])
    out = scoring.score(lambda h, start: logits, torch.zeros(2, 1), torch.tensor([1, 1]),
                        [scoring.ScoredRow("r", 0, 2, 0, 0)], 2)
    assert out[0].logprobs == [scoring.LOGPROB_FLOOR, scoring.LOGPROB_FLOOR]


# ---- which positions a chunked prefill scores ----------------------------------------------------
def _seq(prompt: list[int], k: int = 1) -> Sequence:
    return Sequence(SeqRequest("r", prompt, None, SamplingSpec(prompt_logprobs=k), max_tokens=4))


@pytest.mark.parametrize("cuts", [[13], [1, 12], [5, 5, 3], [4, 8, 1], [12, 1]])
def test_chunks_score_every_prompt_token_once(cuts):
    prompt = list(range(100, 113))
    seq = _seq(prompt)
    scored_targets: list[int] = []
    start = 0
    for n in cuts:
        scored, following = prompt_scoring(seq, start, n)
        row = RowPlan("r", prompt[start:start + n], start, [0], None, start + n == len(prompt), seq.req.sampling,
                      prompt_scored=scored, prompt_next=following)
        found = scoring.scored_positions(row, 0)
        if found is not None:
            assert found[0].start_pos == start
            scored_targets += found[1]
        start += n
    assert scored_targets == prompt[1:]


def test_a_recomputed_row_scores_the_prompt_only():
    prompt = [5, 6, 7, 8]
    seq = _seq(prompt)
    seq.output_ids = [9, 10]
    assert prompt_scoring(seq, 0, 6) == (3, -1)
    assert prompt_scoring(seq, 3, 3) == (0, -1)  # the prompt's last position scores the first output token
    assert prompt_scoring(_seq(prompt, k=-1), 0, 4) == (0, -1)


def test_prompt_logprob_requests_never_start_from_cached_pages():
    assert reuses_prefix(SeqRequest("a", [1, 2], None, SamplingSpec(), 1))
    assert not reuses_prefix(SeqRequest("a", [1, 2], None, SamplingSpec(prompt_logprobs=0), 1))
    assert not reuses_prefix(SeqRequest("a", [1, 2], None, SamplingSpec(presence_penalty=0.5), 1))


# ---- the daemon's book and the wire ---------------------------------------------------------------
def test_book_keeps_the_first_values_and_drops_gaps():
    book = PromptLogprobBook(1)
    book.add(PromptLogprobChunk("r", 1, [-1.0, -2.0], [1, 2], [[7], [8]], [[-0.5], [-0.6]]))
    book.add(PromptLogprobChunk("r", 5, [-9.0], [1], [[1]], [[-9.0]]))  # a gap: dropped
    book.add(PromptLogprobChunk("r", 1, [-1.5, -2.5, -3.0], [3, 3, 3], [[1], [1], [9]], [[0.0], [0.0], [-0.7]]))
    assert book.logprobs == [-1.0, -2.0, -3.0] and book.ranks == [1, 2, 3]
    assert book.top_ids == [[7], [8], [9]]
    assert book.reply([4, 5, 6, 7, 8], None) is None  # token 4 not scored yet
    reply = book.reply([4, 5, 6, 7], None)
    assert reply.logprobs == [None, -1.0, -2.0, -3.0] and reply.ranks == [None, 1, 2, 3]
    assert reply.top[0].token_ids == [] and reply.top[3].token_ids == [9]


def test_prompt_logprob_limits_are_checked():
    msg = GenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3], prompt_logprobs=20)
    check_prompt_logprobs(msg, MAX_PROMPT_LOGPROB_ENTRIES // 21)
    with pytest.raises(Rejected) as exc:
        check_prompt_logprobs(msg, MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1)
    assert exc.value.code == "too_large"
    for bad in (21, -1):
        with pytest.raises(Exception) as err:
            codec.decode(codec.encode(GenerateRequest(request_id="x", prompt_token_ids=[1], prompt_logprobs=bad)))
        assert "prompt_logprobs" in str(err.value)


def test_rows_and_results_cross_the_wire():
    spec = SamplingSpec(prompt_logprobs=3)
    plan = StepPlan(1, [RowPlan("r", [4, 5, 6], 0, [2], None, False, spec, prompt_scored=3, prompt_next=7)])
    delta = codec.decode(codec.encode(EngineStepDelta(delta=PlanEncoder().encode(plan))))
    row = PlanBook().expand(delta.delta).rows[0]
    assert (row.prompt_scored, row.prompt_next, row.sampling.prompt_logprobs) == (3, 7, 3)
    result = StepResult(1, [], prompt_logprobs=[PromptLogprobChunk("r", 1, [-0.25, -1.5], [1, 4], [[3], [2]],
                                                                    [[-0.25], [-0.5]])])
    back = codec.decode(codec.encode(EngineStepDone(result=result))).result
    assert back.prompt_logprobs == result.prompt_logprobs


# ---- the engine against transformers + PEFT ------------------------------------------------------
pytest.importorskip("transformers")
pytest.importorskip("peft")


def _check_prompt(out, model_dir: Path, adapter_dir: Path | None, k: int, tol: float, seed: int) -> float:
    ref = reference(model_dir, adapter_dir, out.prompt_token_ids)  # [P, vocab] float64
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:], dtype=torch.int64)[:, None])[:, 0]
    worst = max((abs(a - float(b)) for a, b in zip(out.prompt_logprobs[1:], want)), default=0.0)
    assert worst < tol, f"adapter {out.adapter}: prompt logprob error {worst} (seed {seed})"
    if k:
        assert out.prompt_top_logprobs[0] is None
        for p, top in enumerate(out.prompt_top_logprobs[1:]):
            values, ids = torch.topk(ref[p], k + 1)
            assert len(top) == k
            for token, lp in top.items():
                assert abs(lp - float(ref[p][token])) < tol, f"seed {seed}"
            # the k most likely, except where the k-th and the next tie within the tolerance
            if float(values[k - 1] - values[k]) > 2 * tol:
                assert set(top) == set(ids[:k].tolist()), f"seed {seed}"
    else:
        assert out.prompt_top_logprobs is None
    return worst


@pytest.mark.parametrize("page_tokens,batched", [(4, 32), (16, 2048)])
def test_engine_prompt_logprobs_match_peft_in_mixed_batches(demo, page_tokens, batched):
    """Every row of one batch its own adapter (or none); some ask for prompt logprobs (k 0..3),
    others only generate; max_batched_tokens 32 chunks the prompts across steps."""
    seed = _fresh_seed()
    llm = LLM(demo.model_dir, page_tokens=page_tokens, num_pages=512, max_batched_tokens=batched)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    g = torch.Generator().manual_seed(seed)
    names = [None, "qv-r8", "attn-r16", "all-r32", "mlp-r64", "rslora-r16", "kdown-r8", "qv-r8"]
    ks = [2, 0, None, 3, 1, None, 2, 0]
    lengths = [1] + torch.randint(2, 90, (len(names) - 1,), generator=g).tolist()  # one token: [None]
    prompts = [torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=k)
              for k in ks]
    outs = llm.generate(prompts, adapters=names, sampling=params)
    tol = forward_tolerance(llm.config)
    adapters = dict(demo.adapters)
    for out, k in zip(outs, ks):
        if k is None:
            assert out.prompt_logprobs is None
            continue
        _check_prompt(out, demo.model_dir, adapters.get(out.adapter), k, tol, seed)
    for out in outs:  # every row's completion, asked or not, is still the model's (where no near-tie)
        ref = reference(demo.model_dir, adapters.get(out.adapter), out.prompt_token_ids + out.token_ids[:-1])
        for token, row in zip(out.token_ids, ref[len(out.prompt_token_ids) - 1:]):
            top2 = torch.topk(row, 2).values
            if float(top2[0] - top2[1]) > 2 * tol:
                assert token == int(row.argmax()), f"seed {seed}"


def test_a_cached_prefix_never_serves_prompt_logprobs(demo):
    """A prompt whose KV the prefix cache holds (a plain request ran it first) is computed again for
    prompt logprobs; asked twice, they are the same, and the model's."""
    seed = _fresh_seed()
    llm = LLM(demo.model_dir, page_tokens=4, num_pages=256)
    llm.add_adapter("attn-r16", demo.adapters["attn-r16"])
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, llm.config.vocab_size, (61,), generator=g).tolist()
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], adapters="attn-r16", sampling=plain)
    assert llm.scheduler.prefix_reuse.cache.peek("attn-r16", prompt) > 0  # the cache holds the prompt now
    asked = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    first = llm.generate([prompt], adapters="attn-r16", sampling=asked)[0]
    second = llm.generate([prompt], adapters="attn-r16", sampling=asked)[0]
    assert first.prompt_logprobs == second.prompt_logprobs
    assert first.prompt_top_logprobs == second.prompt_top_logprobs
    _check_prompt(second, demo.model_dir, demo.adapters["attn-r16"], 2, forward_tolerance(llm.config), seed)


def test_triton_backend_prompt_logprobs_match_peft(demo):
    """LoRA and paged attention through the Triton kernels (interpreted on CPU): the same prompt
    logprobs, with a chunked prefill."""
    pytest.importorskip("triton")
    seed = _fresh_seed()
    llm = LLM(demo.model_dir, lora_backend="triton", page_tokens=16, num_pages=256, dtype="float32",
              max_batched_tokens=24)
    names = ["all-r32", None, "qv-r8"]
    for name in {n for n in names if n}:
        llm.add_adapter(name, demo.adapters[name])
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, llm.config.vocab_size, (n,), generator=g).tolist() for n in (19, 11, 6)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, adapters=names, sampling=params)
    tol = forward_tolerance(llm.config)
    for out in outs:
        _check_prompt(out, demo.model_dir, demo.adapters[out.adapter] if out.adapter else None, 2, tol, seed)


def test_tp2_prompt_logprobs_equal_one_device(demo, tmp_path):
    """Two tensor-parallel ranks (gloo on CPU) score the prompt as one device does: every rank joins
    each chunk's vocabulary-parallel LM head gather, rank 0 alone gets the logprobs."""
    from safetensors.torch import load_file

    from tests.tp_engine_support import EngineCase, single_device, spawn_engine

    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    names = [None, "qv-r8", "mlp-r64", "rslora-r16"]
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (4,), generator=g)]
    adapters = {n: str(demo.adapters[n]) for n in names if n}
    case = EngineCase(str(demo.model_dir), adapters, prompts, names, new_tokens=2, extra={"prompt_logprobs": 2})
    one = EngineCase(**{**case.__dict__, "extra": {"prompt_logprobs": 2}})
    single_device(one)
    want = torch.tensor(one.extra["scored"], dtype=torch.float64)
    spawn_engine(2, [case], tmp_path)
    got = load_file(str(tmp_path / "result.safetensors"))["scored.0"]
    assert got.shape == want.shape == (sum(len(p) - 1 for p in prompts),)
    from loraplex.gpu_engine.model.config import ModelConfig

    worst = (got - want).abs().max().item()
    assert worst < forward_tolerance(ModelConfig.from_dir(demo.model_dir)), f"worst {worst} (seed {seed})"
