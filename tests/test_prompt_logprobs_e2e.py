"""Prompt logprobs end to end: a real daemon (chunked prefill: 48 tokens a step) and the gateway,
sent exactly what lm-evaluation-harness's `local-completions` sends for loglikelihood tasks
(echo, logprobs 1, max_tokens 1, prompts of context + continuation token ids, several per
request, adapters side by side) and checked against transformers + PEFT; vLLM's
prompt_logprobs field; max_tokens 0; the prefix cache; the client library; the refusals."""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.daemon_process import DaemonProcess
from tests.hf_reference import prompt_logprobs as reference
from tests.test_gateway_e2e import BASE, GatewayThread, _post

pytest.importorskip("transformers")
pytest.importorskip("peft")
from loraplex.gateway.config import GatewayConfig  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def _token_tol(model_dir) -> float:
    """float32 engine vs float64 reference per token: 16 sqrt(n) ulps over the n terms of the
    forward's chained reductions, as tests/test_prompt_logprobs.py derives it."""
    cfg = json.loads((model_dir / "config.json").read_text())
    n = cfg["num_hidden_layers"] * (cfg["hidden_size"] + cfg["intermediate_size"]) + cfg["hidden_size"]
    return 16 * EPS32 * math.sqrt(n)


@pytest.fixture(scope="module")
def daemon(demo, tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("pld"),
                         env={"LORAPLEX_SCHEDULER_MAX_BATCHED_TOKENS": "48"}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def gateway(daemon):
    gw = GatewayThread(GatewayConfig(port=0, runtime_dir=daemon.runtime_dir, stats_cache_s=0.0)).start()
    yield gw
    gw.close()


def _completions(gateway, body: dict) -> dict:
    status, text = _post(f"{gateway.url}/v1/completions", body)
    assert status == 200, text
    return json.loads(text)


def _continuation_logprob(model_dir, adapter_dir, context: list[int], continuation: list[int]) -> float:
    ref = reference(model_dir, adapter_dir, context + continuation)
    rows = ref[len(context) - 1: len(context) + len(continuation) - 1]
    return float(rows.gather(1, torch.tensor(continuation)[:, None]).sum())


def test_loglikelihood_requests_as_lm_eval_sends_them(gateway, demo):
    """Each adapter's request carries several context + continuation prompts; the requests run side
    by side, so the daemon batches rows of different adapters; the continuation's summed logprob
    (lm-eval: token_logprobs[ctxlen:-1]) is transformers + PEFT's."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    vocab = 512
    cases = {}
    for model in (BASE, "qv-r8", "all-r32", "mlp-r64"):
        pairs = []
        for _ in range(3):
            ctx_len, cont_len = (int(x) for x in torch.randint(1, 60, (2,), generator=g))
            pairs.append((torch.randint(3, vocab, (ctx_len,), generator=g).tolist(),
                          torch.randint(3, vocab, (cont_len,), generator=g).tolist()))
        cases[model] = pairs

    def ask(model: str, max_tokens: int) -> dict:
        return _completions(gateway, {"model": model, "prompt": [c + x for c, x in cases[model]], "temperature": 0,
                                      "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True})

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = dict(zip(cases, pool.map(lambda m: ask(m, 1), cases)))
        echo_only = dict(zip(cases, pool.map(lambda m: ask(m, 0), cases)))
    adapters = {None: None, **demo.adapters}
    tol = _token_tol(demo.model_dir)
    for model, pairs in cases.items():
        adapter_dir = adapters[None if model == BASE else model]
        for choice, only, (context, continuation) in zip(answers[model]["choices"], echo_only[model]["choices"],
                                                        pairs):
            logprobs = choice["logprobs"]
            n = len(context) + len(continuation)
            assert len(logprobs["token_logprobs"]) == n + 1  # the prompt's tokens, then the generated one
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
            got = sum(logprobs["token_logprobs"][len(context):-1])
            want = _continuation_logprob(demo.model_dir, adapter_dir, context, continuation)
            assert abs(got - want) < tol * len(continuation), f"{model}: {got} vs {want} (seed {seed})"
            for lp, top in zip(logprobs["token_logprobs"][1:-1], logprobs["top_logprobs"][1:-1]):
                assert 1 <= len(top) <= 2 and max(top.values()) >= lp - tol
            # max_tokens 0: the echo alone, the same prompt logprobs (another batch: equal within rounding)
            alone = only["logprobs"]["token_logprobs"]
            assert len(alone) == n and alone[0] is None
            assert all(abs(a - b) < tol for a, b in zip(alone[1:], logprobs["token_logprobs"][1:-1]))
            assert only["text"] == choice["text"][:len(only["text"])] and only["finish_reason"] == "length"
        assert echo_only[model]["usage"]["completion_tokens"] == 0
        assert answers[model]["usage"]["completion_tokens"] == len(pairs)


def test_vllm_prompt_logprobs_and_echoed_text(gateway, demo):
    body = {"model": "attn-r16", "prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    answer = _completions(gateway, body)
    scored = answer["choices"][0]["prompt_logprobs"]
    assert len(scored) == answer["usage"]["prompt_tokens"] and scored[0] is None
    for entry in scored[1:]:
        first = next(iter(entry.values()))  # the prompt token's own entry comes first
        assert first["logprob"] <= 0 and len(entry) == (2 if first["rank"] <= 2 else 3)
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]
    echoed = _completions(gateway, {**body, "prompt_logprobs": None, "echo": True, "logprobs": 0})
    choice = echoed["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert choice["text"].startswith("The quick brown fox")
    prompt_tokens = echoed["usage"]["prompt_tokens"]
    assert "".join(tokens[:prompt_tokens]).endswith("The quick brown fox")  # pieces join into the prompt
    tol = _token_tol(demo.model_dir)
    assert all(abs(a - next(iter(e.values()))["logprob"]) < tol
               for a, e in zip(choice["logprobs"]["token_logprobs"][1:prompt_tokens], scored[1:], strict=True))


def test_a_cached_prefix_gives_the_same_prompt_logprobs(gateway, daemon):
    """The prompt's KV is in the prefix cache after a plain request; prompt-logprob requests compute
    it again (cached_tokens 0) and agree with each other; a plain request still reuses it."""
    prompt = list(range(40, 140))
    plain = {"model": "qv-r8", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    _completions(gateway, plain)
    assert _completions(gateway, plain)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    asked = {**plain, "echo": True, "logprobs": 3}
    first, second = _completions(gateway, asked), _completions(gateway, asked)
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_client_library_returns_prompt_logprobs(daemon):
    with daemon.client() as client:
        result = client.generate([7, 8, 9, 10, 11], adapter="kdown-r8", max_tokens=1, temperature=0.0,
                                 prompt_logprobs=3)
        scored = result.prompt_logprobs
        assert scored.token_ids == [7, 8, 9, 10, 11] and scored.logprobs[0] is None and scored.ranks[0] is None
        assert all(lp <= 0 for lp in scored.logprobs[1:]) and all(r >= 1 for r in scored.ranks[1:])
        assert [len(t.token_ids) for t in scored.top] == [0, 3, 3, 3, 3]
        for lp, rank, top in zip(scored.logprobs[1:], scored.ranks[1:], scored.top[1:]):
            assert top.logprobs == sorted(top.logprobs, reverse=True)
            assert (rank == 1) == (lp >= top.logprobs[0])
        assert client.generate([7, 8, 9], max_tokens=1).prompt_logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
    ({"prompt_logprobs": 1, "stream": True}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_prompt_logprob_requests_are_400s(gateway, body, param):
    status, text = _post(f"{gateway.url}/v1/completions", {"model": BASE, "prompt": "x", **body})
    assert status == 400 and json.loads(text)["error"]["param"] == param, text


def test_cpu_assisted_prefill_scores_the_prompt(demo, tmp_path):
    """A cold adapter's prefill whose early layers the CPU workers compute (loads throttled) gives
    the prompt logprobs transformers + PEFT gives."""
    seed = int.from_bytes(os.urandom(4), "little")
    prompt = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(seed)).tolist()
    proc = DaemonProcess(tmp_path, "--adapter-load-mode", "cpu_assist", "--cpu-workers", "2",
                         env={"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "3e6"}).start()
    try:
        with proc.client() as client:
            got = client.generate(prompt, adapter="all-r32", max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                  timeout=120)
    finally:
        assert proc.stop() == 0, proc.log()
    assert got.timings["adapter_path"] == "cpu_assisted"
    ref = reference(demo.model_dir, demo.adapters["all-r32"], prompt)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert got.prompt_logprobs.logprobs[0] is None and got.prompt_logprobs.top is None
    worst = max(abs(a - b) for a, b in zip(got.prompt_logprobs.logprobs[1:], want, strict=True))
    assert worst < _token_tol(demo.model_dir), f"worst {worst} (seed {seed})"
