"""Property tests: decode never crashes, never hangs, and valid messages round-trip."""
from __future__ import annotations

import time

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.ipc.codec import decode, encode
from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.protocol import (
    ADAPTER_PATHS,
    FINISH_REASONS,
    MAX_TOKEN_ID,
    CancelRequest,
    DoneReply,
    ErrorReply,
    GenerateRequest,
    Message,
    SetPolicyRequest,
    StatsReply,
    TokenChunk,
    message_types,
)

# Generous for CI noise; a pathological input would take orders of magnitude more.
MAX_DECODE_S = 5.0  # generous: a loaded 2-core CI machine must not make this flaky; a real blow-up is minutes
# Example counts keep the whole file near five seconds.
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_is_total(data: bytes) -> Message | None:
    """decode returns a Message or raises ProtocolError (never INTERNAL, which
    would mean a validator bug), quickly."""
    start = time.perf_counter()
    try:
        msg = decode(data)
    except ProtocolError as exc:
        assert exc.code is not ErrorCode.INTERNAL, str(exc)
        msg = None
    elapsed = time.perf_counter() - start
    assert elapsed < MAX_DECODE_S, f"decode took {elapsed:.3f}s on {len(data)} bytes"
    if msg is not None:
        assert isinstance(msg, Message)
        # Anything accepted must re-encode to something that decodes equal.
        assert decode(encode(msg)) == msg
    return msg


@settings(FUZZ, max_examples=1000)
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(data: bytes) -> None:
    _decode_is_total(data)


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=16,
)


@FUZZ
@given(_plain)
def test_arbitrary_msgpack_structures(value: object) -> None:
    _decode_is_total(msgpack.packb(value, use_bin_type=True))


def _field_names() -> list[str]:
    names = {"v", "type", "request_id", "extra"}
    for cls in message_types().values():
        names.update(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    return sorted(names)


# Envelopes with a real type and real field names but random values: this
# reaches every validator instead of stopping at the envelope checks.
_envelopes = st.builds(
    lambda type_name, fields, v: {**fields, "v": v, "type": type_name},
    st.sampled_from(sorted(message_types())),
    st.dictionaries(st.sampled_from(_field_names()), _plain, max_size=6),
    st.sampled_from([1, 1, 1, 0, 2, True, "1", None]),
)


@FUZZ
@given(_envelopes)
def test_envelopes_with_random_fields(body: dict[str, object]) -> None:
    _decode_is_total(msgpack.packb(body, use_bin_type=True))


_request_ids = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=128)
_names = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=128).filter(lambda s: s not in (".", ".."))
_token_ids = st.lists(st.integers(min_value=0, max_value=MAX_TOKEN_ID), min_size=1, max_size=200)
_ms = st.floats(min_value=0.0, max_value=1e7)

_generate = st.builds(
    GenerateRequest,
    request_id=_request_ids,
    prompt=st.none(),
    prompt_token_ids=_token_ids,
    adapter=st.none() | _names,
    max_tokens=st.integers(min_value=1, max_value=1_000_000),
    temperature=st.floats(min_value=0.0, max_value=100.0),
    top_p=st.floats(min_value=1e-6, max_value=1.0),
    top_k=st.just(-1) | st.integers(min_value=1, max_value=2**31 - 1),
    seed=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=256), max_size=16),
    stop_token_ids=st.lists(st.integers(min_value=0, max_value=MAX_TOKEN_ID), max_size=20),
    ignore_eos=st.booleans(),
    stream=st.booleans(),
    logprobs=st.booleans(),
    priority=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    slo_ttft_ms=st.none() | st.floats(min_value=0.001, max_value=3_600_000.0),
    deadline_ms=st.none() | st.floats(min_value=0.001, max_value=86_400_000.0),
)
_text_generate = st.builds(GenerateRequest, request_id=_request_ids, prompt=st.text(max_size=500))


@st.composite
def _token_chunks(draw: st.DrawFn) -> TokenChunk:
    ids = draw(st.lists(st.integers(min_value=0, max_value=MAX_TOKEN_ID), max_size=50))
    logprobs = draw(st.none() | st.lists(st.floats(min_value=-1e30, max_value=0.0),
                                         min_size=len(ids), max_size=len(ids)))
    return TokenChunk(
        request_id=draw(_request_ids), token_ids=ids, text=draw(st.text(max_size=100)),
        logprobs=logprobs, index=draw(st.integers(min_value=0, max_value=2**40)),
    )


@st.composite
def _dones(draw: st.DrawFn) -> DoneReply:
    completion = draw(st.integers(min_value=0, max_value=10_000))
    timings: dict[str, float | str] = {"queue_ms": draw(_ms), "e2e_ms": draw(_ms),
                                       "adapter_path": draw(st.sampled_from(ADAPTER_PATHS))}
    if completion:
        timings.update(ttft_ms=draw(_ms), tpt_ms=draw(_ms))
    return DoneReply(
        request_id=draw(_request_ids), finish_reason=draw(st.sampled_from(FINISH_REASONS)),
        usage={"prompt_tokens": draw(st.integers(min_value=0, max_value=10**6)), "completion_tokens": completion},
        timings=timings, token_ids=draw(st.lists(st.integers(min_value=0, max_value=MAX_TOKEN_ID), max_size=50)),
        text=draw(st.text(max_size=100)),
    )


_finite_plain = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)

_valid_messages = st.one_of(
    _generate,
    _text_generate,
    _token_chunks(),
    _dones(),
    st.builds(CancelRequest, request_id=_request_ids),
    st.builds(ErrorReply, request_id=st.none() | _request_ids, code=st.sampled_from([c.value for c in ErrorCode]),
              message=st.text(max_size=300)),
    st.builds(StatsReply, stats=st.dictionaries(st.text(max_size=10), _finite_plain, max_size=6),
              request_id=st.none() | _request_ids),
    st.builds(SetPolicyRequest, kind=st.sampled_from(["scheduler", "cache"]), name=_names,
              request_id=st.none() | _request_ids),
)


@settings(FUZZ, max_examples=200)
@given(_valid_messages)
def test_valid_messages_round_trip(msg: Message) -> None:
    data = encode(msg)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert encode(back) == data


@FUZZ
@given(_valid_messages, st.data())
def test_mutated_valid_messages(msg: Message, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        pos = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        raw[pos] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=1, max_value=len(raw)))
    _decode_is_total(bytes(raw[:cut]))
