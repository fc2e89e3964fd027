"""What crosses Ray between the ingress and the replicas: plain dicts of str, int, float and
lists (Ray serializes them; no loraplex object travels), and their conversion to and from the
client library's types. A replica's LoraplexError arrives at the ingress with its code, so the
gateway answers it as it would the daemon's.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from loraplex.ipc.client_calls import GENERATE_OPTIONS, generate_request
from loraplex.ipc.client_types import Choice, GenerateResult, StreamChunk
from loraplex.ipc.errors import ErrorCode, LoraplexError
from loraplex.ipc.protocol import PromptLogprobs, TopLogprobs


def request(prompt: str | Sequence[int], adapter: str | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """One generate for a replica; raises ValueError for an unknown option and ProtocolError for
    a field the daemon would refuse (as AsyncClient.stream does)."""
    # Checked with the client library's own validation at the ingress, so a bad field gets its
    # 400 there and never reaches a replica.
    unknown = sorted(set(options) - GENERATE_OPTIONS)
    if unknown:
        raise ValueError(f"unknown generate options {unknown}")
    generate_request(prompt, adapter=adapter, stream=True, **options)
    if not isinstance(prompt, str):
        prompt = [int(t) for t in prompt]
    return {"prompt": prompt, "adapter": adapter, "options": dict(options)}


def prompt_len(payload: Mapping[str, Any]) -> int:
    """Rough prompt length in tokens for routing (a text prompt counts ~4 characters a token)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    return len(prompt) if isinstance(prompt, list) else 0


def accepted_event(replica: str) -> dict[str, Any]:
    """A replica's first event: the request is queued there (the ingress may move it until its first token)."""
    return {"accepted": replica}


def chunk_event(chunk: StreamChunk) -> dict[str, Any]:
    return {"chunk": asdict(chunk)}


def result_event(result: GenerateResult) -> dict[str, Any]:
    return {"result": asdict(result)}


def error_event(exc: LoraplexError) -> dict[str, Any]:
    return {"error": {"code": exc.code.value, "message": exc.message, "request_id": exc.request_id}}


def _top(raw: list[Mapping[str, Any]] | None) -> list[TopLogprobs] | None:
    return None if raw is None else [TopLogprobs(**t) for t in raw]


def to_chunk(raw: Mapping[str, Any]) -> StreamChunk:
    """A chunk from its event (asdict flattened its nested records into maps)."""
    return StreamChunk(**{**raw, "top_logprobs": _top(raw.get("top_logprobs"))})


def to_result(raw: Mapping[str, Any]) -> GenerateResult:
    """A result from its event, its choices and top logprobs rebuilt as records."""
    choices = [Choice(**{**c, "top_logprobs": _top(c.get("top_logprobs"))}) for c in raw.get("choices", ())]
    scored = raw.get("prompt_logprobs")
    if scored is not None:
        scored = PromptLogprobs(**{**scored, "top": _top(scored.get("top"))})
    return GenerateResult(**{**raw, "top_logprobs": _top(raw.get("top_logprobs")), "choices": choices,
                             "prompt_logprobs": scored})


def to_error(raw: Mapping[str, Any]) -> LoraplexError:
    try:
        code = ErrorCode.parse(str(raw.get("code")))
    except ValueError:
        code = ErrorCode.INTERNAL
    return LoraplexError(code, str(raw.get("message", "")), raw.get("request_id"))
