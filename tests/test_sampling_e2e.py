"""The sampling surface end to end on a real daemon with the demo model: the client
library (sync and async), `loraplex generate` and the OpenAI gateway through the
official `openai` client: top logprobs, penalties, logit_bias, min_tokens, echo,
/tokenize, /detokenize, /version."""
from __future__ import annotations

import asyncio
import json

import pytest

from loraplex import cli
from loraplex.ipc.client import AsyncClient, LoraplexError
# The module's own daemon and gateway, started by the same fixtures as the gateway's e2e tests.
from tests.test_gateway_e2e import BASE, _post, daemon, gateway  # noqa: F401

openai = pytest.importorskip("openai")
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture
def oai(gateway):
    with gateway.client() as c:
        yield c


def test_client_top_logprobs_bias_and_min_tokens(daemon):
    with daemon.client() as client:
        result = client.generate("The river", adapter="qv-r8", top_logprobs=3, **GREEDY)
        assert len(result.top_logprobs) == len(result.logprobs) == len(result.token_ids) == 8
        for token, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
            assert len(top.token_ids) == 3 and top.logprobs == sorted(top.logprobs, reverse=True)
            assert top.token_ids[0] == token and top.logprobs[0] == pytest.approx(lp)  # greedy: the most likely
            assert all(isinstance(t, str) for t in top.texts) and any(top.texts)
        # +100 on one token makes greedy pick it every time, with any adapter or none.
        token = result.token_ids[-1]
        for adapter in (None, "all-r32"):
            forced = client.generate("The river", adapter=adapter, logit_bias={token: 100.0}, **GREEDY)
            assert forced.token_ids == [token] * 8
        # Penalties change a greedy run that repeats itself; the same request twice is still deterministic.
        plain = client.generate([5, 6, 7], **GREEDY | {"max_tokens": 24})
        penalised = [client.generate([5, 6, 7], presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                                     **GREEDY | {"max_tokens": 24}).token_ids for _ in range(2)]
        assert penalised[0] == penalised[1] != plain.token_ids
        assert len(set(penalised[0])) >= len(set(plain.token_ids))
        eos = client.generate([5, 6, 7], logit_bias={2: 100.0}, temperature=0.0, max_tokens=8, min_tokens=5)
        assert eos.token_ids[5:] == [2] and 2 not in eos.token_ids[:5]  # EOS is the demo's token 2
        assert eos.finish_reason == "stop"
        with pytest.raises(LoraplexError) as info:
            client.generate("x", logit_bias={10**6: 1.0}, max_tokens=2)
        assert info.value.code.value == "invalid_token"
        with pytest.raises(ValueError):
            client.generate("x", presence_penalty=3.0)


def test_client_tokenize_detokenize_and_async_streams(daemon):
    with daemon.client() as client:
        tokens = client.tokenize("Once upon a time")
        assert tokens.token_ids and tokens.max_model_len == 4096
        assert client.detokenize(tokens.token_ids).endswith("Once upon a time")
        assert client.tokenize("").token_ids == []

    async def run() -> tuple[list, list]:
        async with AsyncClient(runtime_dir=daemon.runtime_dir) as client:
            stream = client.stream("The river", top_logprobs=2, frequency_penalty=1.0, **GREEDY)
            chunks = [chunk async for chunk in stream]
            return chunks, stream.result.top_logprobs

    chunks, tops = asyncio.run(run())
    streamed = [top for chunk in chunks for top in (chunk.top_logprobs or [])]
    assert len(streamed) == 8 and streamed == tops and all(len(t.token_ids) == 2 for t in tops)


def test_cli_generate_prints_logprobs(daemon, capsys):
    argv = ["generate", "--runtime-dir", str(daemon.runtime_dir), "--max-tokens", "4", "--ignore-eos",
            "--logprobs", "2", "--presence-penalty", "0.5", "--logit-bias", "7=-100", "Once upon"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 4 and all(len(line.split("\t")) == 2 for line in lines)
    assert all(not line.startswith("7\t") for line in lines)
    assert cli.main(argv[:-3] + ["--logit-bias", "x", "Once upon"]) == 1
    assert "--logit-bias takes ID=BIAS" in capsys.readouterr().err


def test_gateway_top_logprobs_penalties_and_echo(oai):
    extra = {"extra_body": {"ignore_eos": True}}
    done = oai.completions.create(model="qv-r8", prompt="The river", logprobs=3, max_tokens=6, temperature=0.0,
                                  **extra).choices[0]
    assert len(done.logprobs.top_logprobs) == 6
    for lp, top in zip(done.logprobs.token_logprobs, done.logprobs.top_logprobs):
        # Three alternatives, each decoded alone; byte tokens that decode alike share one key.
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp)
    for model in (BASE, "all-r32"):
        chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                           top_logprobs=3, max_tokens=5, temperature=0.0, **extra).choices[0]
        assert len(chat.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
                   for t in chat.logprobs.content)
    streamed = list(oai.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                logprobs=True, top_logprobs=2, max_tokens=4, temperature=0.0,
                                                stream=True, **extra))
    alternatives = [t.top_logprobs for c in streamed if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]
    assert len(alternatives) == 4 and all(len(a) == 2 for a in alternatives)
    penalised = oai.completions.create(model=BASE, prompt="The river", presence_penalty=1.5, frequency_penalty=1.0,
                                       max_tokens=6, temperature=0.0, logit_bias={"7": -100},
                                       extra_body={"repetition_penalty": 1.3, "min_tokens": 2, "ignore_eos": True})
    assert penalised.usage.completion_tokens == 6
    plain = oai.completions.create(model=BASE, prompt="The river", max_tokens=6, temperature=0.0, **extra)
    echoed = oai.completions.create(model=BASE, prompt="The river", max_tokens=6, temperature=0.0, echo=True, **extra)
    assert echoed.choices[0].text == "The river" + plain.choices[0].text
    ids = oai.completions.create(model=BASE, prompt=[5, 6, 7], max_tokens=3, temperature=0.0, echo=True, **extra)
    chunks = list(oai.completions.create(model=BASE, prompt=[5, 6, 7], max_tokens=3, temperature=0.0, echo=True,
                                         stream=True, **extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ids.choices[0].text
    for bad in ({"logprobs": 2, "echo": True}, {"logit_bias": {"x": 1}}, {"logit_bias": {"5": 500}},
                {"presence_penalty": 9}, {"logprobs": 21}):
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model=BASE, prompt="x", max_tokens=2, **bad)


def test_gateway_tokenize_detokenize_version(gateway):
    status, body = _post(f"{gateway.url}/tokenize", {"prompt": "Once upon a time"})
    assert status == 200
    tokens = json.loads(body)
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    status, body = _post(f"{gateway.url}/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and json.loads(body)["prompt"].endswith("Once upon a time")
    status, body = _post(f"{gateway.url}/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(body)["count"] > 0
    for path, bad in (("tokenize", {"prompt": 3}), ("detokenize", {"tokens": ["a"]}),
                      ("detokenize", {"tokens": [10**7]})):
        status, body = _post(f"{gateway.url}/{path}", bad)
        assert status == 400, body
    import urllib.request

    with urllib.request.urlopen(f"{gateway.url}/version", timeout=30) as response:
        assert json.loads(response.read())["version"]
