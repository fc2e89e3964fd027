"""Structured output requests (vLLM's guided decoding, OpenAI's response_format): what a
completion's text must match, as one (kind, spec) pair that travels on the wire.

Owns the constructors and the torch-free checks every side runs before a grammar is
compiled: a JSON schema must be a JSON object, a choice a list of strings, a regex
non-empty, and none may nest deeper than MAX_GUIDED_DEPTH (checked by a flat scan, before
any recursive parser sees the text). Whether a schema or regex compiles, and within the
server's time and memory limits, is the grammar library's verdict (daemon/grammar_gate.py,
gpu_engine/grammar.py), returned as the request's error. `grammar_key` names a grammar
on both sides of the engine link.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from loraplex.ipc.engine_plan import GUIDED_KINDS, MAX_GUIDED_CHOICES, MAX_GUIDED_DEPTH, MAX_GUIDED_SPEC

# One left-to-right pass each, without backtracking (possessive loops; an unterminated string or
# class runs to the end), drops what cannot nest: JSON strings, regex escapes and character classes.
_JSON_LITERAL = re.compile(r'"(?:[^"\\]|\\[\s\S])*(?:"|\\?\Z)')
_REGEX_LITERAL = re.compile(r"\\[\s\S]?|\[\^?\]?(?:[^\]\\]|\\[\s\S]?)*(?:\]|\Z)")
_NOT_JSON_BRACKET = re.compile(r"[^\[\]{}]+")
_NOT_REGEX_GROUP = re.compile(r"[^()]+")
_NESTING = {"[": 1, "{": 1, "(": 1, "]": -1, "}": -1, ")": -1}


class GrammarTooComplex(ValueError):
    """A spec past a structural limit (its nesting depth): the request's code is grammar_too_complex."""


@dataclass(frozen=True, slots=True)
class Guided:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        check_guided(self.kind, self.spec)

    @classmethod
    def json(cls, schema: Mapping[str, Any] | str) -> Guided:
        """Text that parses as JSON and validates against `schema`."""
        if isinstance(schema, str):
            return cls("json_schema", schema)
        try:
            text = json.dumps(schema)
        except RecursionError:  # nested far past MAX_GUIDED_DEPTH
            raise GrammarTooComplex(f"guided decoding: the json_schema nests deeper than Python can encode; the "
                                    f"limit is {MAX_GUIDED_DEPTH}") from None
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Guided:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Guided:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Guided:
        """Exactly one of `options`."""
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise ValueError("guided choice: options must be a list of strings")
        return cls("choice", json.dumps(list(options)))


def check_guided(kind: str, spec: str) -> None:
    """ValueError naming what is wrong with (kind, spec)."""
    if kind not in GUIDED_KINDS:
        raise ValueError(f"guided decoding: kind must be one of {GUIDED_KINDS}, got {str(kind)[:32]!r}")
    if not isinstance(spec, str) or len(spec) > MAX_GUIDED_SPEC:
        raise ValueError(f"guided decoding: the {kind} must be a string of at most {MAX_GUIDED_SPEC} characters")
    if kind == "json_object":
        if spec:
            raise ValueError("guided decoding: json_object takes no spec")
        return
    if not spec:
        raise ValueError(f"guided decoding: the {kind} is empty")
    depth = nesting_depth(kind, spec)
    if depth > MAX_GUIDED_DEPTH:
        raise GrammarTooComplex(f"guided decoding: the {kind} nests {depth} levels deep; the limit is "
                                f"{MAX_GUIDED_DEPTH}")
    if kind == "regex":
        return
    try:
        value = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"guided decoding: the {kind} is not valid JSON: {exc}") from None
    if kind == "json_schema" and not isinstance(value, dict):
        raise ValueError("guided decoding: a JSON schema must be a JSON object")
    if kind == "choice" and not (isinstance(value, list) and 1 <= len(value) <= MAX_GUIDED_CHOICES
                                 and all(isinstance(c, str) and c for c in value)):
        raise ValueError(f"guided decoding: a choice must be 1..{MAX_GUIDED_CHOICES} non-empty strings")


def nesting_depth(kind: str, spec: str) -> int:
    """How deep `spec` nests: JSON objects and arrays (strings skipped), or a regex's groups
    (escapes and character classes skipped). Linear, no recursion: safe on any input."""
    if kind == "regex":
        brackets = _NOT_REGEX_GROUP.sub("", _REGEX_LITERAL.sub("", spec))
    else:
        brackets = _NOT_JSON_BRACKET.sub("", _JSON_LITERAL.sub("", spec))
    return max(accumulate(map(_NESTING.__getitem__, brackets)), default=0)


def grammar_key(kind: str, spec: str) -> str:
    """A grammar's name in step plans and results (and the compile caches): a digest of (kind, spec)."""
    return hashlib.sha256(f"{kind}\0{spec}".encode()).hexdigest()[:32]
