"""The sampling surface end to end on a real daemon with the demo model: the client
library (sync and async), `loraplex generate` and the OpenAI gateway through the
official `openai` client: top logprobs, penalties, logit_bias, min_tokens, echo,
/tokenize, /detokenize, /version."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import re

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
    for bad in ({"extra_body": {"prompt_logprobs": 21}}, {"logit_bias": {"x": 1}}, {"logit_bias": {"5": 500}},
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


def test_n_choices_through_the_client(daemon):
    with daemon.client() as client:
        seeded = [client.generate("The river", n=3, seed=11, temperature=1.0, max_tokens=10, ignore_eos=True,
                                  logprobs=True) for _ in range(2)]
        first, again = seeded
        assert [c.index for c in first.choices] == [0, 1, 2]
        assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]  # reproducible
        assert len({tuple(c.token_ids) for c in first.choices}) == 3  # siblings sample with distinct seeds
        assert first.text == first.choices[0].text and first.token_ids == first.choices[0].token_ids
        assert first.usage["completion_tokens"] == 30 and first.usage["prompt_tokens"] > 0
        assert all(len(c.logprobs) == 10 for c in first.choices)
        alone = client.generate("The river", seed=12, temperature=1.0, max_tokens=10, ignore_eos=True)
        assert alone.token_ids == first.choices[1].token_ids  # choice i samples with seed + i
        greedy = client.generate([5, 6, 7], n=2, adapter="qv-r8", **GREEDY)
        assert greedy.choices[0].token_ids == greedy.choices[1].token_ids
        stream = client.stream([5, 6, 7], n=4, max_tokens=6, ignore_eos=True, temperature=1.0)
        counts = [0] * 4
        for chunk in stream:
            counts[chunk.choice] += len(chunk.token_ids)
        assert counts == [6] * 4 and stream.result.usage["completion_tokens"] == 24
        # Cancelling ends every choice with one reply.
        stream = client.stream([5, 6, 7], n=3, max_tokens=4000, ignore_eos=True, temperature=1.0,
                               request_id="many-choices")
        next(iter(stream))
        client.cancel("many-choices")
        list(stream)
        assert stream.result.finish_reason == "cancelled"
        assert [c.finish_reason for c in stream.result.choices] == ["cancelled"] * 3
        assert client.generate("x", n=2, max_tokens=2).choices[1].index == 1  # nothing left in flight
        with pytest.raises(ValueError):
            client.generate("x", n=129, max_tokens=2)


def test_n_choices_through_the_gateway(oai, daemon, capsys):
    for model in (BASE, "all-r32"):
        done = oai.completions.create(model=model, prompt="The river", n=2, max_tokens=6, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
        assert [c.index for c in done.choices] == [0, 1] and done.usage.completion_tokens == 12
        assert done.choices[0].text != done.choices[1].text
        chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=5, temperature=1.0, seed=3, logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True})
        assert [c.index for c in chat.choices] == [0, 1]
        assert all(len(c.logprobs.content) == 5 and all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
                   for c in chat.choices)
    batch = oai.completions.create(model=BASE, prompt=["a river", "the sea"], n=2, max_tokens=4, temperature=0.0,
                                   extra_body={"ignore_eos": True})
    single = [oai.completions.create(model=BASE, prompt=p, max_tokens=4, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in ("a river", "the sea")]
    assert [c.text for c in batch.choices] == [single[0], single[0], single[1], single[1]]
    texts = ["", "", "", ""]
    for chunk in oai.completions.create(model=BASE, prompt=["a river", "the sea"], n=2, max_tokens=4, stream=True,
                                        temperature=0.0, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in batch.choices]
    argv = ["generate", "--runtime-dir", str(daemon.runtime_dir), "--max-tokens", "3", "--ignore-eos", "--n", "2",
            "--temperature", "1", "--seed", "5", "--logprobs", "0", "Once upon"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "--- choice 1 [length]" in out and len([line for line in out.splitlines() if "\t" in line]) == 6
    if importlib.util.find_spec("xgrammar") is None:
        return
    argv = ["generate", "--runtime-dir", str(daemon.runtime_dir), "--max-tokens", "10", "--choice", "yes",
            "--choice", "no", "Yes or no?"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] in ("yes", "no")
    assert cli.main(argv[:5] + ["--json-schema", "[1]", "x"]) == 1
    assert "JSON schema must be a JSON object" in capsys.readouterr().err


PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _person(text: str) -> dict:
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 10
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    return value


def test_done_check_n2_top_logprobs_and_json_schema_through_openai(oai):
    """The issue's check: n=2 gives two choices, top_logprobs=3 three alternatives per token,
    response_format with a JSON schema text that parses and validates, for an adapter and the base."""
    pytest.importorskip("xgrammar")  # the engine extra's grammar library
    messages = [{"role": "user", "content": "Describe a person."}]
    two = oai.chat.completions.create(model="qv-r8", messages=messages, n=2, max_tokens=6, temperature=1.0, seed=9)
    assert len(two.choices) == 2
    scored = oai.chat.completions.create(model=BASE, messages=messages, logprobs=True, top_logprobs=3, max_tokens=6,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    assert all(len(t.top_logprobs) == 3 for t in scored.choices[0].logprobs.content)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for model in ("qv-r8", BASE):
        for temperature in (0.0, 1.0):
            chat = oai.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=120,
                                               temperature=temperature, seed=4, n=2)
            for choice in chat.choices:
                assert choice.finish_reason == "stop", choice.message.content
                _person(choice.message.content)
    streamed = oai.chat.completions.create(model="all-r32", messages=messages, response_format=fmt, max_tokens=120,
                                           temperature=0.7, seed=5, stream=True)
    _person("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    obj = oai.chat.completions.create(model=BASE, messages=messages, response_format={"type": "json_object"},
                                      max_tokens=120, temperature=0.0).choices[0]
    # Any JSON object may go on past max_tokens (the demo model likes long strings): a prefix of one, then.
    assert obj.message.content.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    choice = oai.completions.create(model="qv-r8", prompt="Yes or no?", max_tokens=10, temperature=0.0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = oai.completions.create(model=BASE, prompt="Code:", max_tokens=20, temperature=1.0, seed=2,
                                   extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    for bad in ({"guided_regex": "(ab"}, {"guided_json": {"type": "no-such-type"}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=BASE, prompt="x", max_tokens=4, extra_body=bad)
        assert info.value.status_code == 400 and info.value.message


def test_done_check_a_repeated_long_prompt_is_cached_through_openai(oai, daemon):
    """The issue's check for the prefix cache: a repeated long prompt reports cached_tokens > 0
    in usage and gives the same greedy text as the first time; `loraplex stats` shows the hits."""
    prompt = "ROMEO: " + " ".join(f"word{i}" for i in range(120))
    first = oai.completions.create(model="qv-r8", prompt=prompt,
                                   **{k: v for k, v in GREEDY.items() if k != "ignore_eos"},
                                   extra_body={"ignore_eos": True})
    again = oai.completions.create(model="qv-r8", prompt=prompt,
                                   **{k: v for k, v in GREEDY.items() if k != "ignore_eos"},
                                   extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text
    with daemon.client() as client:
        assert client.stats()["prefix_cache"]["hit_tokens"] >= again.usage.prompt_tokens_details.cached_tokens
