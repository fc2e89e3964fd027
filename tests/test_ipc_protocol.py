"""Protocol declarations and the codec: round trips and every validation rule."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated

import msgpack
import pytest

from loraplex.ipc.adapter_store import store_entry_layout
from loraplex.ipc.codec import DecodeLimits, decode, encode
from loraplex.ipc.engine_plan import (
    AdapterPlacement,
    GrammarOrder,
    RowPlan,
    RowResult,
    SamplingSpec,
    StepPlan,
    StepResult,
)
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.exchange import exchange_layout, llama_module_shapes
from loraplex.ipc.messages.checks import InInterval, InRange, Length, TokenIds
from loraplex.ipc.plan_delta import PlanEncoder
from loraplex.ipc.protocol import (
    PROTOCOL_VERSION,
    AdaptersReply,
    AddAdapterRequest,
    AdminOkReply,
    CacheHello,
    CacheStoreFull,
    CancelRequest,
    ChoiceOutcome,
    CpuCalibrate,
    CpuCalibration,
    CpuJobDone,
    CpuJobSlice,
    CpuLoraJob,
    CpuWorkerFailure,
    CpuWorkerHello,
    CpuWorkerShutdown,
    DetokenizedReply,
    DetokenizeRequest,
    DoneReply,
    DrainRequest,
    EngineAdapterLoaded,
    EngineFailure,
    EngineHello,
    EngineLoadAdapter,
    EngineShutdown,
    EngineStep,
    EngineStepDelta,
    EngineStepDone,
    EngineUnloadAdapter,
    ErrorReply,
    GenerateRequest,
    GrammarCompile,
    GrammarCompiled,
    GrammarWorkerHello,
    ListAdaptersRequest,
    Message,
    PauseRequest,
    PinAdapterRequest,
    PingRequest,
    PongReply,
    PromptLogprobs,
    RemoveAdapterRequest,
    SetPolicyRequest,
    StatsReply,
    StatsRequest,
    TokenChunk,
    TokenizedReply,
    TokenizeRequest,
    TopLogprobs,
    message_types,
    register,
)

_EXCHANGE = exchange_layout("/lpx-0123456789ab-exchange", 2, llama_module_shapes(64, 64, 32, 96), 16)
_ENTRY = store_entry_layout("sql", 8, {"q_proj": (64, 64), "down_proj": (96, 64)}, 2, "bfloat16").at(4096)

TIMINGS = {"queue_ms": 1.5, "ttft_ms": 20.25, "tpt_ms": 7.0, "e2e_ms": 90.0, "adapter_path": "cpu_assisted"}

_PLAN = StepPlan(
    step_id=7,
    rows=[RowPlan(request_id="ab/r1", token_ids=[5, 6, 7], start_pos=3, kv_pages=[9, 2], adapter="sql",
                  sample=True, sampling=SamplingSpec(temperature=0.5, top_p=0.9, top_k=40, seed=11, logprobs=True),
                  sample_index=2)],
    place=[AdapterPlacement(name="sql", pages=[4, 1])],
    evict=["old"],
    grammars=[GrammarOrder(kind="regex", spec="[a-z]+")],
)

# One instance per registered type, every field away from its default.
SAMPLES: list[Message] = [
    EngineHello(pid=42, model_dir="/m", device="cuda:0", dtype="bfloat16", vocab_size=512, num_layers=4,
                hidden_size=256, kv_dim=128, max_model_len=4096, num_pages=100, page_tokens=16, page_elems=4096,
                eos_token_ids=[2], bos_token_id=1, lora_backend="triton", demo_adapters={"a": "/d/a"},
                load_mode="cpu_assist", link_bytes_per_s=2.5e10, store_segment="/lpx-0123456789ab-store",
                exchange=_EXCHANGE, cuda_graphs=True, graph_buckets=[1, 2, 4], graph_reason="n/a",
                tensor_parallel_size=2, cpu_threads=7, rank_pids=[4243], kv_window=4096),
    EngineLoadAdapter(name="sql", path="/adapters/sql", store_segment="/lpx-0123456789ab-store-g1", store_entry=_ENTRY,
                      keep_resident=True),
    CacheHello(pid=43, store_segment="/lpx-0123456789ab-store-g1", capacity_bytes=1 << 20, dtype="bfloat16",
               model_dir="/m", demo_adapters={"a": "/d/a"}),
    CacheStoreFull(name="sql", needed_bytes=4096, free_bytes=1024, largest_free=512, rank=16, target_modules=["q_proj"],
                   num_pages=3, nbytes=4000, scaling=0.5),
    EngineAdapterLoaded(name="sql", rank=16, target_modules=["q_proj"], num_pages=3, nbytes=1024, store_entry=_ENTRY,
                        scaling=0.5),
    EngineUnloadAdapter(name="sql"),
    EngineStep(plan=_PLAN),
    EngineStepDelta(delta=PlanEncoder().encode(_PLAN)),
    EngineStepDone(result=StepResult(step_id=7, rows=[RowResult(request_id="ab/r1", token_id=3, logprob=-0.5)],
                                     forward_ms=1.5, sample_ms=0.25, grammars_ready=["ab12"])),
    EngineShutdown(),
    EngineFailure(code="engine_failed", message="boom", subject="7", fatal=True),
    CpuWorkerHello(index=3, pid=4242, core=5, torch_threads=2),
    CpuLoraJob(job_id=9, seq=3, exchange=_EXCHANGE, store="/lpx-0123456789ab-store", layers=[0, 1],
               slices=[CpuJobSlice(token_start=0, token_count=5, entry=_ENTRY, scaling=2.0),
                       CpuJobSlice(token_start=8, token_count=8, entry=_ENTRY, scaling=0.5, cpu_layers=1)],
               deadline_ms=500, start_deadline_ms=3000, generation=7, arena_base=0),
    CpuJobDone(job_id=9, index=3, busy_ms=1.25, tokens=13, wait_ms=0.5, sites=8),
    CpuWorkerFailure(index=3, code="timeout", message="site 4: timeout", job_id=9, fatal=True, calibration_id=2),
    CpuCalibrate(request_id=2, hidden=4096, ranks=[8, 16], tokens=128, repeats=3, dtype="bfloat16"),
    CpuCalibration(request_id=2, index=3, hidden=4096, tokens=128, ranks=[8, 16], tokens_per_s=[2.5e5, 2.0e5],
                   dtype="bfloat16", cpu_model="AMD EPYC", torch_version="2.13.0"),
    CpuWorkerShutdown(),
    GrammarWorkerHello(pid=4244, vocab_size=512),
    GrammarCompile(kind="json_schema", spec='{"type": "object"}', timeout_s=5.0, memory_bytes=1 << 30),
    GrammarCompiled(verdict="too_complex", message="the json_schema did not compile within 5 s", seconds=5.01),
    GenerateRequest(
        request_id="req-7f3a",
        prompt_token_ids=[1, 15043, 2],
        adapter="sql-lora_v2.1",
        max_tokens=513,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=2**63 - 1,
        stop=["\n\n", "###"],
        stop_token_ids=[13, 29889],
        ignore_eos=True,
        stream=True,
        logprobs=True,
        top_logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias={"13": -100.0, "450": 2.5},
        min_tokens=3,
        n=2,
        guided_kind="json_schema",
        guided_spec='{"type": "object"}',
        priority=-3,
        slo_ttft_ms=250.0,
        deadline_ms=30_000.0,
        prompt_logprobs=2,
    ),
    CancelRequest(request_id="req-7f3a"),
    TokenizeRequest(request_id="t1", prompt="héllo"),
    DetokenizeRequest(request_id="t2", token_ids=[1, 15043]),
    TokenizedReply(request_id="t1", token_ids=[1, 15043], max_model_len=4096),
    DetokenizedReply(request_id="t2", text="<s> hello"),
    ListAdaptersRequest(request_id="l1"),
    StatsRequest(request_id="s1"),
    PingRequest(request_id="p1"),
    TokenChunk(request_id="req-7f3a", token_ids=[450, 4996], text=" the cat", logprobs=[-0.25, -1.5], index=12,
               top_logprobs=[TopLogprobs(token_ids=[450, 7], logprobs=[-0.25, -2.0], texts=[" the", "a"]),
                             TopLogprobs(token_ids=[4996, 9], logprobs=[-1.5, -1.75], texts=[" cat", " dog"])],
               choice=1),
    DoneReply(
        request_id="req-7f3a",
        finish_reason="length",
        usage={"prompt_tokens": 3, "completion_tokens": 2},
        timings=TIMINGS,
        token_ids=[450, 4996],
        text=" the cat",
        choices=[ChoiceOutcome(index=0, finish_reason="length", token_ids=[450, 4996], text=" the cat"),
                 ChoiceOutcome(index=1, finish_reason="stop", token_ids=[2], text="")],
        prompt_logprobs=PromptLogprobs(token_ids=[1, 15043], texts=["", "hi"], logprobs=[None, -3.25], ranks=[None, 7],
                                       top=[TopLogprobs(token_ids=[], logprobs=[], texts=[]),
                                            TopLogprobs(token_ids=[9], logprobs=[-0.5], texts=["a"])]),
    ),
    ErrorReply(request_id="req-7f3a", code="unknown_adapter", message="no adapter named 'x'"),
    AdaptersReply(
        adapters=[{"name": "a1", "path": "/srv/a1", "rank": 16, "target_modules": ["q_proj", "v_proj"],
                   "state": "gpu", "pinned": True}],
        request_id="l1",
    ),
    StatsReply(stats={"queue_depth": 3, "gpu": {"util": 0.5, "pages": [1, 2]}, "name": "x"}, request_id="s1"),
    PongReply(request_id="p1"),
    AddAdapterRequest(name="a1", path="/srv/adapters/a1", request_id="adm-1", replace=True),
    RemoveAdapterRequest(name="a1", request_id="adm-2"),
    PinAdapterRequest(name="a1", pinned=False, request_id="adm-3"),
    DrainRequest(timeout_s=2.5, request_id="adm-4"),
    SetPolicyRequest(kind="cache", name="lru", request_id="adm-5"),
    PauseRequest(paused=False, request_id="adm-6"),
    AdminOkReply(detail={"evicted": ["a2"], "pages_freed": 12}, request_id="adm-1"),
]


# Fields that must stay at their default in the sample because another field
# excludes them (exactly one prompt kind); test_text_prompt_* covers them.
EXCLUSIVE = {("generate", "prompt")}


def _production_types() -> dict[str, type[Message]]:
    return {name: cls for name, cls in message_types().items() if not name.startswith("test_")}


def test_every_registered_type_has_a_sample() -> None:
    assert {type(m).TYPE for m in SAMPLES} == set(_production_types())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_round_trip_with_non_default_values(msg: Message) -> None:
    for f in dataclasses.fields(msg):
        if (msg.TYPE, f.name) in EXCLUSIVE:
            continue
        if f.default is not dataclasses.MISSING:
            assert getattr(msg, f.name) != f.default, f"{msg.TYPE}.{f.name} left at its default"
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(msg, f.name) != f.default_factory(), f"{msg.TYPE}.{f.name} left at its default"
    data = encode(msg)
    body = msgpack.unpackb(data)
    assert body["v"] == PROTOCOL_VERSION and body["type"] == msg.TYPE
    # Every field is written, none omitted.
    assert set(body) == {"v", "type"} | {f.name for f in dataclasses.fields(msg)}
    back = decode(data)
    assert type(back) is type(msg) and back == msg


def test_text_prompt_and_defaults_round_trip() -> None:
    msg = GenerateRequest(request_id="r", prompt="héllo wörld")
    back = decode(encode(msg))
    assert back == msg and back.max_tokens == 64 and back.temperature == 1.0 and back.top_k == -1


def test_omitted_defaulted_fields_take_defaults() -> None:
    back = decode(msgpack.packb({"v": 1, "type": "generate", "request_id": "r", "prompt": "x"}))
    assert isinstance(back, GenerateRequest) and back.top_p == 1.0 and back.stop == []


def test_int_for_float_is_widened_and_tuples_become_lists() -> None:
    msg = GenerateRequest(request_id="r", prompt="x", temperature=0, stop=("a",))  # type: ignore[arg-type]
    assert type(msg.temperature) is float and msg.stop == ["a"]
    back = decode(msgpack.packb({"v": 1, "type": "drain", "timeout_s": 5}))
    assert isinstance(back, DrainRequest) and type(back.timeout_s) is float


def _raw(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def _gen(**overrides: object) -> bytes:
    body: dict[str, object] = {"v": 1, "type": "generate", "request_id": "r1", "prompt": "hi"}
    body.update(overrides)
    return msgpack.packb(body, use_bin_type=True)


def _done(**overrides: object) -> bytes:
    body: dict[str, object] = {
        "v": 1, "type": "done", "request_id": "r1", "finish_reason": "stop",
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "timings": dict(TIMINGS),
    }
    body.update(overrides)
    return msgpack.packb(body, use_bin_type=True)


BAD = ErrorCode.BAD_MESSAGE
FIELD = ErrorCode.INVALID_FIELD

REJECTIONS = {
    # envelope
    "garbage": (b"\xc1\x00\xff", BAD),
    "empty": (b"", BAD),
    "truncated": (_gen()[:-3], BAD),
    "trailing bytes": (_gen() + b"\x00", BAD),
    "top-level array": (msgpack.packb([1, "generate"]), BAD),
    "top-level int": (msgpack.packb(7), BAD),
    "missing v": (_raw(type="ping"), BAD),
    "v as bool": (_raw(v=True, type="ping"), BAD),
    "v as str": (_raw(v="1", type="ping"), BAD),
    "wrong v": (_raw(v=2, type="ping"), ErrorCode.UNSUPPORTED_VERSION),
    "missing type": (_raw(v=1), BAD),
    "type not str": (_raw(v=1, type=3), BAD),
    "unknown type": (_raw(v=1, type="teleport"), ErrorCode.UNKNOWN_TYPE),
    "ext type": (msgpack.packb({"v": 1, "type": "stats_snapshot", "stats": {"x": msgpack.ExtType(42, b"boom")}}), BAD),
    "timestamp ext": (msgpack.packb({"v": 1, "type": "stats_snapshot", "stats": {"t": msgpack.Timestamp(5, 0)}}), BAD),
    "int map key": (msgpack.packb({1: 2, "v": 1, "type": "ping"}), BAD),
    "invalid utf-8": (b"\x82\xa1v\x01\xa4type\xa4\xff\xfe\xfd\xfc", BAD),
    "unknown field": (_gen(temperaturee=0.5), FIELD),
    "missing required field": (_raw(v=1, type="cancel"), FIELD),
    # types
    "bool as int": (_gen(max_tokens=True), FIELD),
    "bool as float": (_gen(temperature=False), FIELD),
    "str as float": (_gen(temperature="0.5"), FIELD),
    "float as int": (_gen(max_tokens=5.0), FIELD),
    "bytes as str": (_gen(prompt=b"hi"), FIELD),
    "bool token id": (_gen(prompt=None, prompt_token_ids=[1, True]), FIELD),
    "stop not a list": (_gen(stop="###"), FIELD),
    # ranges
    "NaN temperature": (_gen(temperature=math.nan), FIELD),
    "inf temperature": (_gen(temperature=math.inf), FIELD),
    "negative temperature": (_gen(temperature=-0.1), FIELD),
    "temperature above 100": (_gen(temperature=100.5), FIELD),
    "top_p 0": (_gen(top_p=0.0), FIELD),
    "top_p above 1": (_gen(top_p=1.01), FIELD),
    "top_k 0": (_gen(top_k=0), FIELD),
    "top_k -2": (_gen(top_k=-2), FIELD),
    "negative max_tokens": (_gen(max_tokens=-1), FIELD),
    "zero max_tokens": (_gen(max_tokens=0), FIELD),
    "huge max_tokens": (_gen(max_tokens=1_000_001), FIELD),
    "negative seed": (_gen(seed=-1), FIELD),
    "seed 2^63": (_gen(seed=2**63), FIELD),
    "priority beyond int32": (_gen(priority=2**31), FIELD),
    "NaN slo": (_gen(slo_ttft_ms=math.nan), FIELD),
    "zero deadline": (_gen(deadline_ms=0.0), FIELD),
    "both prompt kinds": (_gen(prompt_token_ids=[1, 2]), FIELD),
    "neither prompt kind": (_gen(prompt=None), FIELD),
    "empty token prompt": (_gen(prompt=None, prompt_token_ids=[]), FIELD),
    "negative token id": (_gen(prompt=None, prompt_token_ids=[1, -5]), ErrorCode.INVALID_TOKEN),
    "token id beyond int32": (_gen(prompt=None, prompt_token_ids=[2**31]), ErrorCode.INVALID_TOKEN),
    "negative stop token": (_gen(stop_token_ids=[-1]), ErrorCode.INVALID_TOKEN),
    # strings and lists
    "over-long request_id": (_gen(request_id="r" * 129), FIELD),
    "empty request_id": (_gen(request_id=""), FIELD),
    "request_id with space": (_gen(request_id="a b"), FIELD),
    "over-long adapter name": (_gen(adapter="a" * 129), FIELD),
    "adapter name with slash": (_gen(adapter="../etc"), FIELD),
    "adapter name dot-dot": (_gen(adapter=".."), FIELD),
    "too many stop strings": (_gen(stop=[str(i) for i in range(17)]), FIELD),
    "over-long stop string": (_gen(stop=["x" * 257]), FIELD),
    "empty stop string": (_gen(stop=[""]), FIELD),
    # replies and admin
    "unknown error code": (_raw(v=1, type="error", request_id=None, code="oops", message="m"), FIELD),
    "bad finish_reason": (_done(finish_reason="tired"), FIELD),
    "usage missing key": (_done(usage={"prompt_tokens": 1}), FIELD),
    "negative usage": (_done(usage={"prompt_tokens": -1, "completion_tokens": 0}), FIELD),
    "timings missing ttft": (_done(timings={"queue_ms": 1.0, "e2e_ms": 2.0, "tpt_ms": 1.0, "adapter_path": "base"}),
                             FIELD),
    "bad adapter_path": (_done(timings={**TIMINGS, "adapter_path": "teleported"}), FIELD),
    "negative timing": (_done(timings={**TIMINGS, "queue_ms": -1.0}), FIELD),
    "logprobs length": (_raw(v=1, type="token", request_id="r", token_ids=[1, 2], logprobs=[-1.0]), FIELD),
    "adapter entry rank -1": (
        _raw(v=1, type="adapter_list",
             adapters=[{"name": "a", "path": "/a", "rank": -1, "target_modules": [], "state": "host"}]),
        FIELD,
    ),
    "relative adapter path": (_raw(v=1, type="add_adapter", name="a", path="adapters/a"), FIELD),
    "bad policy kind": (_raw(v=1, type="set_policy", kind="engine", name="x"), FIELD),
    "drain timeout 0": (_raw(v=1, type="drain", timeout_s=0.0), FIELD),
    "pinned as int": (_raw(v=1, type="pin_adapter", name="a", pinned=1), FIELD),
}


@pytest.mark.parametrize("data,code", list(REJECTIONS.values()), ids=list(REJECTIONS))
def test_rejections_carry_the_right_code(data: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert info.value.code is code, str(info.value)


def test_oversized_payload_is_too_large() -> None:
    limits = DecodeLimits(max_message_bytes=1024)
    big = GenerateRequest(request_id="r", prompt="x" * 2000)
    with pytest.raises(ProtocolError) as info:
        decode(encode(big), limits)
    assert info.value.code is ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolError) as info:
        encode(big, limits)
    assert info.value.code is ErrorCode.TOO_LARGE


def test_msgpack_length_limits_are_too_large() -> None:
    tight = DecodeLimits(max_array_len=8, max_str_len=16, max_map_len=4)
    cases = [
        _gen(prompt=None, prompt_token_ids=list(range(9))),
        _gen(prompt="y" * 17),
        msgpack.packb({"v": 1, "type": "stats_snapshot", "stats": {str(i): i for i in range(5)}}),
    ]
    for data in cases:
        with pytest.raises(ProtocolError) as info:
            decode(data, tight)
        assert info.value.code is ErrorCode.TOO_LARGE


def test_errors_name_the_request_when_readable() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(_gen(request_id="abc-1", temperature=math.nan))
    assert info.value.request_id == "abc-1"
    with pytest.raises(ProtocolError) as info:
        decode(_gen(request_id="bad id", top_p=0.0))
    assert info.value.request_id is None


def test_construction_validates_like_decode() -> None:
    with pytest.raises(ProtocolError) as info:
        GenerateRequest(request_id="r", prompt="x", max_tokens=True)
    assert info.value.code is FIELD
    with pytest.raises(ValueError):  # ProtocolError is a ValueError
        GenerateRequest(request_id="r", prompt="x", prompt_token_ids=[1])


def test_done_without_tokens_needs_no_ttft() -> None:
    done = DoneReply(
        request_id="r", finish_reason="cancelled", usage={"prompt_tokens": 4, "completion_tokens": 0},
        timings={"queue_ms": 3.0, "e2e_ms": 3.0, "adapter_path": "base"},
    )
    assert decode(encode(done)) == done


def test_error_reply_and_exceptions_convert() -> None:
    err = ProtocolError(ErrorCode.INVALID_FIELD, "x" * 10_000, request_id="r9")
    reply = ErrorReply.from_error(err)
    assert reply.request_id == "r9" and reply.code == "invalid_field" and len(reply.message) == 4096
    exc = decode(encode(reply)).to_exception()  # type: ignore[attr-defined]
    assert isinstance(exc, LoraplexError) and exc.code is ErrorCode.INVALID_FIELD and exc.request_id == "r9"
    assert "invalid_field" in str(exc) and "r9" in str(exc)
    assert ErrorReply.from_error(err, request_id="not valid").request_id is None


def test_error_codes_are_stable_lowercase() -> None:
    values = [c.value for c in ErrorCode]
    assert len(values) == len(set(values))
    assert all(v == v.lower() and v.replace("_", "").isalpha() for v in values)
    assert ErrorCode.parse("too_large") is ErrorCode.TOO_LARGE
    with pytest.raises(ValueError):
        ErrorCode.parse("nope")


def test_register_rejects_malformed_declarations() -> None:
    with pytest.raises(TypeError, match="frozen"):
        @register
        @dataclass(slots=True)
        class NotFrozen(Message):
            TYPE = "test_not_frozen"
            x: int = 0

    with pytest.raises(TypeError, match="declared twice"):
        @register
        @dataclass(frozen=True, slots=True)
        class Duplicate(Message):
            TYPE = "ping"

    with pytest.raises(TypeError, match="unsupported"):
        @register
        @dataclass(frozen=True, slots=True)
        class BadField(Message):
            TYPE = "test_bad_field"
            x: set[int] = field(default_factory=set)

    with pytest.raises(TypeError, match="reserved"):
        @register
        @dataclass(frozen=True, slots=True)
        class Reserved(Message):
            TYPE = "test_reserved"
            v: int = 0

    with pytest.raises(TypeError, match="must be Rules"):
        @register
        @dataclass(frozen=True, slots=True)
        class NotARule(Message):
            TYPE = "test_not_a_rule"
            x: Annotated[int, "positive"] = 0

    assert "test_not_frozen" not in message_types() and "test_bad_field" not in message_types()
    assert "test_not_a_rule" not in message_types()


@register
@dataclass(frozen=True, slots=True)
class _Ruled(Message):
    """Rules on a field, on an optional field, on list items and on the list itself."""

    TYPE = "test_ruled"

    count: Annotated[int, InRange(1, 10)]
    limit: Annotated[float, InInterval(0.0, 1.0, lo_open=True)] | None = None
    tags: Annotated[list[Annotated[str, Length(1, 3)]], Length(0, 2)] = field(default_factory=list)
    ids: Annotated[list[int], TokenIds(0, 4)] = field(default_factory=list)


@pytest.mark.parametrize("fields,message", [
    ({"count": 0}, "count: must be in [1, 10], got 0"),
    ({"count": 1, "limit": 0.0}, "limit: must be in (0.0, 1.0], got 0.0"),
    ({"count": 1, "tags": ["abcd"]}, "tags[0]: length must be in [1, 3], got 4"),
    ({"count": 1, "tags": ["a", "b", "c"]}, "tags: length must be in [0, 2], got 3"),
    ({"count": 1, "ids": [1, -1]}, "ids: token id -1 outside"),
])
def test_field_rules_are_declared_once_with_the_type(fields: dict[str, object], message: str) -> None:
    _Ruled(count=1, limit=None, tags=["a", "bcd"], ids=[0, 5])  # within every rule
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb({"v": 1, "type": "test_ruled", **fields}))
    assert message in info.value.message
    assert info.value.code is (ErrorCode.INVALID_TOKEN if "token id" in message else ErrorCode.INVALID_FIELD)


def test_a_list_bound_is_checked_before_its_items() -> None:
    """An over-long list is refused for its length, before any item is looked at."""
    with pytest.raises(ProtocolError, match="length must be in"):
        _Ruled(count=1, tags=[object()] * 3)  # type: ignore[list-item]
    with pytest.raises(ProtocolError, match="length must be in"):
        _Ruled(count=1, ids=[-1] * 5)


# A message with nested records, the shape step plans take.
@dataclass(frozen=True, slots=True)
class _Row:
    request_id: str
    token_ids: list[int]
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a row needs tokens")


@register
@dataclass(frozen=True, slots=True)
class _Plan(Message):
    TYPE = "test_plan"

    step_id: int
    rows: list[_Row]
    weights: dict[str, float] = field(default_factory=dict)


def test_nested_records_round_trip_and_validate() -> None:
    plan = _Plan(step_id=3, rows=[_Row("a", [1, 2]), _Row("b", [3], adapter="x")], weights={"w": 1})
    assert plan.weights == {"w": 1.0}
    assert decode(encode(plan)) == plan
    body = msgpack.unpackb(encode(plan))
    body["rows"][0]["token_ids"] = []
    with pytest.raises(ProtocolError, match="a row needs tokens") as info:
        decode(msgpack.packb(body))
    assert info.value.code is FIELD
    body["rows"][0] = {"request_id": "a", "token_ids": [1], "extra": 1}
    with pytest.raises(ProtocolError, match="extra"):
        decode(msgpack.packb(body))
