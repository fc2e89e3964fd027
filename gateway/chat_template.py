"""Chat prompts: the model's Jinja chat template (tokenizer_config.json,
chat_template.jinja or chat_template.json in the model directory), or a
plain built-in one, rendered in jinja2's immutable sandbox.

Templates come from model files an operator chose, but the messages come
from HTTP clients: rendering never gets Python attribute access or mutation.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("loraplex.gateway")

# "role: content" lines, then the cue for the reply.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template could not be loaded or refused to render these messages."""


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "built-in") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                                            autoescape=False)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson  # as transformers: no HTML escaping, keys kept in order
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template from {origin} does not compile: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The template of the HF model in `model_dir`; the built-in one when it has none (or no dir is given)."""
        if model_dir is None:
            return cls(DEFAULT_TEMPLATE)
        root = Path(model_dir)
        config = _read_json(root / "tokenizer_config.json")
        bos, eos = _token(config.get("bos_token")), _token(config.get("eos_token"))
        source, origin = _pick(config.get("chat_template")), root / "tokenizer_config.json"
        jinja_file, json_file = root / "chat_template.jinja", root / "chat_template.json"
        if source is None and jinja_file.is_file():
            source, origin = jinja_file.read_text(), jinja_file
        if source is None:
            source, origin = _pick(_read_json(json_file).get("chat_template")), json_file
        if source is None:
            log.info("%s has no chat template; using the built-in 'role: content' template", root)
            return cls(DEFAULT_TEMPLATE, bos_token=bos, eos_token=eos)
        return cls(source, bos_token=bos, eos_token=eos, origin=str(origin))

    def render(self, messages: list[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages`; ChatTemplateError when the template rejects them."""
        variables = {**(extra or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as exc:  # includes SecurityError and raise_exception()
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _pick(template: object) -> str | None:
    """A template string; from a list of named templates, the one named "default" (else the first)."""
    if isinstance(template, str) and template:
        return template
    if isinstance(template, list):
        named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
        for t in named:
            if t.get("name") == "default":
                return t["template"]
        return named[0]["template"] if named else None
    return None


def _token(value: object) -> str:
    """bos/eos as tokenizer_config.json writes them: a string, or an AddedToken map with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return ""
