"""Structured output in the engine (offline LLM on the demo model): guided rows (JSON
schema, any JSON object, regex, choice) share batches with free rows and different
adapters, under chunked prefill and preemption; their text always matches, the free
rows' tokens are exactly what they are without guided neighbours, and a grammar that
does not compile fails its request only, with the compiler's reason."""
from __future__ import annotations

import json
import re

import pytest

from loraplex import LLM, Guided, SamplingParams

pytest.importorskip("xgrammar")  # the engine extra's grammar library

# Names by pattern, not maxLength: xgrammar 0.2.8 lets control characters into a string that has a
# maxLength, which strict JSON parsers refuse (README, "Structured output").
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["admin", "user"]},
                                           "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["name", "age", "role"], "additionalProperties": False}
NAMES = ["qv-r8", None, "all-r32", "qv-r8", None, "all-r32"]
PROMPTS = ["Once upon a time", "The river", [5, 6, 7, 8, 9, 10, 11] * 6, "A king", "x", "In the morning"]


def valid_person(text: str) -> bool:
    """SCHEMA, checked by hand (no jsonschema in the test extra)."""
    value = json.loads(text)
    return (isinstance(value, dict) and set(value) <= {"name", "age", "role", "tags"}
            and {"name", "age", "role"} <= set(value) and isinstance(value["name"], str) and len(value["name"]) <= 6
            and isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
            and value["role"] in ("admin", "user")
            and all(isinstance(t, bool) for t in value.get("tags", [])) and len(value.get("tags", [])) <= 3)


def _params(i: int, guided: bool) -> SamplingParams:
    if not guided:
        return SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    grammar = [Guided.json(SCHEMA), None, Guided.regex(r"[a-z]{2,5}-[0-9]{3}"),
               Guided.choice(["yes", "no", "maybe not"]), None, Guided.json_object()][i]
    return SamplingParams(max_tokens=80, temperature=0.0 if i % 2 else 0.9, seed=40 + i, guided=grammar)


def _engine(demo, **kwargs) -> LLM:
    llm = LLM(demo.model_dir, page_tokens=4, **kwargs)
    for name in ("qv-r8", "all-r32") if kwargs.get("num_pages", 512) >= 512 else ("qv-r8",):
        llm.add_adapter(name, demo.adapters[name])
    return llm


@pytest.fixture(scope="module")
def free_alone(demo):
    return _engine(demo, num_pages=512).generate(PROMPTS, adapters=NAMES,
                                                 sampling=[_params(i, False) for i in range(6)])


def _check(i: int, text: str, finish_reason: str) -> None:
    if i == 5:  # any JSON object may run past max_tokens: then a prefix of one
        assert text.startswith("{") and (finish_reason == "length" or isinstance(json.loads(text), dict)), text
        return
    assert finish_reason == "stop", text
    if i == 0:
        assert valid_person(text), text
    elif i == 2:
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text), text
    else:
        assert text in ("yes", "no", "maybe not"), text


@pytest.mark.parametrize("kwargs", [{"num_pages": 512, "max_batched_tokens": 40}, {"num_pages": 0}])
def test_guided_rows_match_and_free_rows_are_untouched(demo, free_alone, kwargs):
    names = NAMES
    if not kwargs["num_pages"]:  # one adapter plus the longest request's KV: the batch preempts
        roomy = _engine(demo, num_pages=512)
        kwargs = {"num_pages": roomy._adapter_pages("qv-r8") + roomy.geometry.kv_pages_for(42 + 80) + 1}
        names = [n and "qv-r8" for n in NAMES]  # the free rows keep theirs (the base model)
    llm = _engine(demo, **kwargs)
    guided = [i not in (1, 4) for i in range(6)]  # rows 1 and 4 run free
    out = llm.generate(PROMPTS, adapters=names, sampling=[_params(i, g) for i, g in enumerate(guided)])
    if kwargs["num_pages"] < 512:
        assert llm.scheduler.num_preemptions > 0
    for i, (g, o) in enumerate(zip(guided, out)):
        if g:
            _check(i, o.text, o.finish_reason)
        else:
            assert o.token_ids == free_alone[i].token_ids


def test_a_grammar_that_does_not_compile_is_refused_with_its_reason(demo):
    llm = _engine(demo, num_pages=512)
    with pytest.raises(ValueError, match="regex.*parenthesis"):
        llm.generate(["x"], sampling=SamplingParams(guided=Guided.regex("(ab")))
    with pytest.raises(ValueError, match="JSON schema must be a JSON object"):
        Guided.json("[1, 2]")
    # In the engine the row fails alone: its result names the error, the other rows sample.
    import torch

    from loraplex.ipc.engine_plan import RowPlan, SamplingSpec

    bad = SamplingSpec(guided_kind="json_schema", guided_spec='{"type": "no-such-type"}')
    rows = [RowPlan(request_id=rid, token_ids=[5, 6], start_pos=0, kv_pages=[0], adapter=None, sample=True,
                    sampling=spec) for rid, spec in (("bad", bad), ("ok", SamplingSpec(temperature=0.0)))]
    logits = torch.randn(2, llm.config.vocab_size)
    results = llm.executor.sampler.sample(logits, rows, rows)
    assert results[0].error.startswith("json_schema") and not results[1].error
    assert results[1].token_id == int(torch.argmax(logits[1]))
