"""Request JSON -> the endpoint's parsed request (`decode`), run on the event loop for small
bodies and, for large ones, in a decoder process first (gateway/json_worker.py).

Never recurses on the body's nesting: a byte scan refuses bodies nested deeper than MAX_DEPTH
before the parser sees them, and whatever the parser still raises (RecursionError included) is
a 400. Pure: no I/O, no event loop; a refusal is returned as data (Refusal), so it can cross
the process boundary.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from loraplex.gateway.errors import ApiError
from loraplex.gateway.schema import parse_chat, parse_completion, parse_detokenize, parse_tokenize

# Deepest nesting of arrays and objects a body may have; OpenAI bodies need under 10 (a
# guided_json schema a few more). The parser and the schema code below it recurse per level.
MAX_DEPTH = 64

# A JSON string, escapes included; an unterminated one runs to the end of the body, so a body of
# `\"` without a closing quote is one linear match, not a rescan from every quote (quadratic).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_OPENERS = bytes.maketrans(b"{}", b"[]")  # one kind of bracket: mismatched kinds are the parser's to find
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_RUNS = re.compile(rb"\[+|\]+")
_DENSE = 16  # a pair-removal pass pays for itself when an innermost pair is at least every 16th bracket


class Refusal(NamedTuple):
    """An ApiError as data."""

    status: int
    message: str
    code: str | None
    param: str | None

    def error(self) -> ApiError:
        return ApiError(self.status, self.message, code=self.code, param=self.param)


def nesting_exceeds(body: bytes | bytearray, limit: int) -> bool:
    """Whether JSON text nests arrays and objects more than `limit` levels deep, found without
    recursion: strings are dropped and the rest cut to its brackets; rounds each remove every
    innermost pair (one level of every branch, at C speed) while such pairs are dense, then the
    depth of what is left is summed run by run in Python (about two runs per _DENSE brackets).
    Brackets that do not match may answer either way: the parser refuses that text anyway.
    Costs about what json.loads of the same body costs, at worst."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    skeleton = _STRING.sub(b"", body).translate(_OPENERS, _NOT_BRACKETS)
    if b"[" * (limit + 1) in skeleton:  # e.g. "[[[[...": decided at once
        return True
    removed, opened = 0, skeleton.count(b"[")
    while removed < limit:
        if opened <= limit - removed:  # what is left cannot reach past the limit
            return False
        pairs = skeleton.count(b"[]")
        if pairs * _DENSE < len(skeleton):  # few pairs (or none): the runs below are few too
            break
        skeleton = skeleton.replace(b"[]", b"")
        removed, opened = removed + 1, opened - pairs
    depth = 0
    for run in _RUNS.finditer(skeleton):
        depth += len(run[0]) if run[0][0] == 0x5B else -len(run[0])
        if depth > limit - removed:
            return True
    return False


# What each endpoint makes of its body, by the name handlers and the decoder process use;
# each takes the decoded JSON and the model's context (None: unknown).
PARSERS: dict[str, Callable[[Any, int | None], Any]] = {
    "json": lambda body, context: body,  # endpoints that read their few fields by hand
    "completions": lambda body, context: parse_completion(body, max_prompt_tokens=context),
    "chat": lambda body, context: parse_chat(body, max_messages=context),
    "tokenize": lambda body, context: parse_tokenize(body, max_messages=context),
    "detokenize": lambda body, context: parse_detokenize(body),
}


def load(body: bytes | bytearray) -> Any:
    """The body's JSON, or the Refusal (a 400 for anything the parser or the nesting bound refuses)."""
    if nesting_exceeds(body, MAX_DEPTH):
        return Refusal(400, f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep",
                       "invalid_json", None)
    try:
        return json.loads(body)
    except RecursionError:
        return Refusal(400, "the request body nests too deeply to parse", "invalid_json", None)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        return Refusal(400, f"the request body is not valid JSON: {exc}", "invalid_json", None)


def parse(value: Any, endpoint: str, context: int | None) -> Any:
    """PARSERS[endpoint] of decoded JSON, or the Refusal of the ApiError it raised."""
    try:
        return PARSERS[endpoint](value, context)
    except ApiError as exc:
        return Refusal(exc.status, exc.message, exc.code, exc.param)


def decode(body: bytes | bytearray, endpoint: str, context: int | None) -> Any:
    """The endpoint's parsed request from the body's bytes, or the Refusal."""
    value = load(body)
    return value if isinstance(value, Refusal) else parse(value, endpoint, context)
