"""Structured output requests (vLLM's guided decoding, OpenAI's response_format): what a
completion's text must match, as one (kind, spec) pair that travels on the wire.

Owns the constructors and the torch-free checks every side runs before a grammar is
compiled: a JSON schema must be a JSON object, a choice a list of strings, a regex
non-empty. Whether a schema or regex compiles is the engine's grammar library's
verdict (gpu_engine.grammar), returned as the request's error.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.ipc.engine_plan import GUIDED_KINDS, MAX_GUIDED_CHOICES, MAX_GUIDED_SPEC


@dataclass(frozen=True, slots=True)
class Guided:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        check_guided(self.kind, self.spec)

    @classmethod
    def json(cls, schema: Mapping[str, Any] | str) -> Guided:
        """Text that parses as JSON and validates against `schema`."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

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
