"""OpenAI request bodies -> validated generation requests.

Owns which OpenAI (and vLLM extension) parameters the gateway accepts and
what it refuses with a 400 rather than silently ignore. Pure functions over
decoded JSON; ranges the daemon checks itself (temperature, seed, stop
lengths...) are left to the client library's message validation.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraplex.gateway.errors import bad_request
from loraplex.gateway.prompt_logprobs import PromptAsk
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.guided import GrammarTooComplex, Guided
from loraplex.ipc.protocol import MAX_CHOICES, MAX_NEW_TOKENS, MAX_PROMPT_TOKEN_IDS, MAX_STOP_TOKEN_IDS

Prompt = str | list[int]
# Completions default (as OpenAI and vLLM). Chat without max_tokens (or max_completion_tokens)
# generates until a stop or the end of the context, as vLLM: the daemon gets max_tokens None and
# gives the request what the context leaves after the prompt.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS_PER_REQUEST = 128
# Token ids in all of one request's prompts (one prompt's most, in the protocol): bounds what the
# gateway's event loop copies and checks for one request (about 0.1 s) whatever the body cap.
MAX_REQUEST_TOKEN_IDS = MAX_PROMPT_TOKEN_IDS
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_TOP_LOGPROBS = 20
# Accepted only at their no-op value: the daemon has no such feature.
_NEUTRAL = {"best_of": 1, "suffix": None, "tools": None, "functions": None, "prompt_logprobs": None,
            "use_beam_search": False}


@dataclass(frozen=True, slots=True)
class Sampling:
    """The generation parameters one HTTP request applies to each of its prompts;
    max_tokens None: until the context is full."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    priority: int = 0
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[str, object], ...] = ()  # as the body gave it
    min_tokens: int = 0
    n: int = 1  # choices per prompt
    guided: Guided | None = None  # structured output
    prompt_logprobs: int | None = None  # the prompt's logprobs with this many alternatives (completions)

    def client_kwargs(self) -> dict[str, object]:
        """Keyword arguments for AsyncClient.stream."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": list(self.stop),
                "stop_token_ids": list(self.stop_token_ids), "ignore_eos": self.ignore_eos,
                "logprobs": self.logprobs, "priority": self.priority, "top_logprobs": self.top_logprobs,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": dict(self.logit_bias),
                "min_tokens": self.min_tokens, "n": self.n, "guided": self.guided,
                "prompt_logprobs": self.prompt_logprobs}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    prompts: list[Prompt]
    sampling: Sampling
    stream: bool
    include_usage: bool
    echo: bool = False  # the prompt's text comes before each choice's completion
    prompt: PromptAsk = PromptAsk()  # what it asks of the prompt's logprobs
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: bool
    include_usage: bool
    add_generation_prompt: bool
    template_kwargs: dict[str, Any]
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def parse_completion(body: object, max_prompt_tokens: int | None = None) -> CompletionRequest:
    """max_prompt_tokens: the model's context, when known; a token-id prompt longer than it is a
    400 here, before its ids are checked one by one."""
    b = _object(body)
    _refuse_unsupported(b, allowed=("prompt_logprobs",))
    logprobs = _opt_int(b, "logprobs", 0, MAX_TOP_LOGPROBS)  # the legacy API: how many alternatives
    echo = _opt_bool(b, "echo", False)
    stream, include_usage = _stream(b)
    ask = _prompt_ask(b, echo, logprobs, stream)
    prompts = _prompts(b.get("prompt"), max_prompt_tokens)
    max_tokens = _opt_int(b, "max_tokens", 0, MAX_NEW_TOKENS)
    sampling = _sampling(b, COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max(1, max_tokens),
                         logprobs=logprobs is not None, top_logprobs=logprobs or 0, prompt_logprobs=ask.alternatives)
    if len(prompts) * sampling.n > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"prompts times n must be at most {MAX_PROMPTS_PER_REQUEST}", "n")
    as_ids = _opt_bool(b, "return_tokens_as_token_ids", False)
    return CompletionRequest(model=_model(b), prompts=prompts, stream=stream, include_usage=include_usage, echo=echo,
                             sampling=sampling, prompt=ask, tokens_as_ids=as_ids)


def _prompt_ask(b: Mapping[str, Any], echo: bool, logprobs: int | None, stream: bool) -> PromptAsk:
    """What a completions body asks of its prompt: echo with logprobs, vLLM's prompt_logprobs, and
    max_tokens 0 (the echo alone, as vLLM: it needs echo)."""
    prompt_logprobs = _opt_int(b, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    ask = PromptAsk(echo_logprobs=logprobs if echo else None, prompt_logprobs=prompt_logprobs,
                    generate=b.get("max_tokens") != 0)
    if not ask.generate and not echo:
        raise bad_request("max_tokens must be at least 1 (0, the prompt alone, only with echo)", "max_tokens")
    if stream and ask.alternatives is not None:
        raise bad_request("prompt logprobs (echo with logprobs, prompt_logprobs) are not streamed; "
                          "send stream=false", "stream", "unsupported_value")
    return ask


def parse_chat(body: object, max_messages: int | None = None) -> ChatRequest:
    """max_messages: the model's context, when known (every message renders to a token at least)."""
    b = _object(body)
    _refuse_unsupported(b)
    if b.get("echo") not in (None, False):
        raise bad_request("echo is not supported for chat", "echo", "unsupported_parameter")
    logprobs = _opt_bool(b, "logprobs", False)
    top = _opt_int(b, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if b.get("tool_choice") not in (None, "none"):
        raise bad_request("tool calling is not supported", "tool_choice", "unsupported_value")
    max_tokens = _opt_int(b, "max_completion_tokens", 1, MAX_NEW_TOKENS)
    if max_tokens is None:
        max_tokens = _opt_int(b, "max_tokens", 1, MAX_NEW_TOKENS)
    stream, include_usage = _stream(b)
    kwargs = b.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    return ChatRequest(
        model=_model(b), messages=_messages(b.get("messages"), max_messages), stream=stream,
        include_usage=include_usage,
        sampling=_sampling(b, max_tokens, logprobs=logprobs, top_logprobs=top),
        add_generation_prompt=_opt_bool(b, "add_generation_prompt", True), template_kwargs=kwargs,
        tokens_as_ids=_opt_bool(b, "return_tokens_as_token_ids", False),
    )


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the chat template."""

    prompt: str | None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool


def parse_tokenize(body: object, max_messages: int | None = None) -> TokenizeRequest:
    b = _object(body)
    _model(b)
    if "messages" in b:
        return TokenizeRequest(None, _messages(b.get("messages"), max_messages),
                               _opt_bool(b, "add_generation_prompt", True))
    prompt = b.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("prompt must be a string (or give chat messages)", "prompt")
    return TokenizeRequest(prompt, [], False)


def parse_detokenize(body: object) -> list[int]:
    b = _object(body)
    _model(b)
    tokens = b.get("tokens")
    if isinstance(tokens, list) and len(tokens) > MAX_REQUEST_TOKEN_IDS:
        raise bad_request(f"at most {MAX_REQUEST_TOKEN_IDS} tokens", "tokens", "too_large")
    if not isinstance(tokens, list) or not _ints(tokens):
        raise bad_request("tokens must be a list of token ids", "tokens")
    return tokens


# ---- pieces ------------------------------------------------------------------------------------
def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _refuse_unsupported(b: Mapping[str, Any], allowed: tuple[str, ...] = ()) -> None:
    for name, neutral in _NEUTRAL.items():
        value = b.get(name)
        if name in allowed:
            continue
        if value is not None and value != neutral and value not in ({}, []):
            raise bad_request(f"{name} is not supported (got {value!r})", name, "unsupported_parameter")


def _model(b: Mapping[str, Any]) -> str | None:
    model = b.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("model must be a non-empty string", "model")
    return model


def _stream(b: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _opt_bool(b, "stream", False)
    options = b.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return stream, _opt_bool(options, "include_usage", False)


def _sampling(b: Mapping[str, Any], max_tokens: int | None, *, logprobs: bool, top_logprobs: int,
              prompt_logprobs: int | None = None) -> Sampling:
    """The sampling fields; their ranges are the client library's message checks (a 400 either way)."""
    temperature = _opt_float(b, "temperature")
    top_p = _opt_float(b, "top_p")
    stop_ids = b.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS \
            or not _ints(stop_ids):
        raise bad_request(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} integers",
                          "stop_token_ids")
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=_top_k(b),
        seed=_opt_int(b, "seed", None, None),
        stop=_stop(b.get("stop")),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_opt_bool(b, "ignore_eos", False),
        logprobs=logprobs,
        priority=_opt_int(b, "priority", None, None) or 0,
        top_logprobs=top_logprobs,
        presence_penalty=_opt_float(b, "presence_penalty") or 0.0,
        frequency_penalty=_opt_float(b, "frequency_penalty") or 0.0,
        repetition_penalty=_or(_opt_float(b, "repetition_penalty"), 1.0),
        logit_bias=_logit_bias(b.get("logit_bias")),
        min_tokens=_opt_int(b, "min_tokens", 0, MAX_NEW_TOKENS) or 0,
        n=_opt_int(b, "n", 1, MAX_CHOICES) or 1,
        guided=_guided(b),
        prompt_logprobs=prompt_logprobs,
    )


def _guided(b: Mapping[str, Any]) -> Guided | None:
    """OpenAI's response_format, or vLLM's guided_json / guided_regex / guided_choice (at most one)."""
    given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice")
             if b.get(name) is not None and b.get(name) != {"type": "text"}]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(given)}", given[1])
    name = given[0]
    value = b[name]
    try:
        if name == "guided_json":
            if not isinstance(value, (dict, str)):
                raise ValueError("guided_json must be a JSON schema (an object, or its text)")
            return Guided.json(value)
        if name == "guided_regex":
            if not isinstance(value, str):
                raise ValueError("guided_regex must be a string")
            return Guided.regex(value)
        if name == "guided_choice":
            if not isinstance(value, list):
                raise ValueError("guided_choice must be a list of strings")
            return Guided.choice(value)
        return _response_format(value)
    except GrammarTooComplex as exc:  # nested past the limit (ipc/guided.py)
        raise bad_request(str(exc), name, code=ErrorCode.GRAMMAR_TOO_COMPLEX.value) from None
    except ValueError as exc:
        raise bad_request(str(exc), name) from None


def _response_format(value: object) -> Guided:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return Guided.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return Guided.json(schema)
    raise ValueError("response_format type must be text, json_object or json_schema")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(bias: object) -> tuple[tuple[str, object], ...]:
    """OpenAI's map of token ids (JSON object keys, so strings) to a bias; the client library checks both."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    return tuple(bias.items())


def _top_k(b: Mapping[str, Any]) -> int:
    top_k = _opt_int(b, "top_k", None, None)
    return -1 if top_k is None or top_k in (0, -1) else top_k  # vLLM: 0 and -1 both disable it


def _stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad_request("stop must be a string or a list of strings", "stop")


def _prompts(prompt: object, max_tokens: int | None) -> list[Prompt]:
    """One string, one list of token ids, or a batch of either. Token-id prompts: each at most
    `max_tokens` long (the context, when known), MAX_REQUEST_TOKEN_IDS in all; both checked
    before the ids are."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        batch = isinstance(prompt[0], (list, str))
        if batch and len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request", "prompt")
        _fit(prompt if batch else [prompt], max_tokens)
        if not batch and _ints(prompt):
            return [list(prompt)]
        if batch and all(isinstance(p, str) or (isinstance(p, list) and p and _ints(p))
                         for p in prompt):
            return [p if isinstance(p, str) else list(p) for p in prompt]
    raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")


def _fit(prompts: list[Any], max_tokens: int | None) -> None:
    """Refuse a token-id prompt longer than the context (as the daemon would) or than any
    prompt can be, and a request whose prompts hold more than MAX_REQUEST_TOKEN_IDS ids."""
    total = 0
    for p in prompts:
        if not isinstance(p, list):
            continue
        if max_tokens is not None and len(p) > max_tokens:
            raise bad_request(f"prompt has {len(p)} tokens; the context holds {max_tokens}", "prompt",
                              "context_length_exceeded")
        total += len(p)
    if total > MAX_REQUEST_TOKEN_IDS:
        raise bad_request(f"the prompts hold {total} token ids; at most {MAX_REQUEST_TOKEN_IDS} per request",
                          "prompt", "too_large")


def _messages(messages: object, max_messages: int | None) -> list[dict[str, Any]]:
    """Chat messages with their content flattened to text (text parts joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    if len(messages) > (most := MAX_PROMPT_TOKEN_IDS if max_messages is None else max_messages):
        raise bad_request(f"{len(messages)} messages cannot fit in a prompt of {most} tokens", "messages",
                          "context_length_exceeded")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise bad_request(f"messages[{i}] must be an object whose role is one of {sorted(CHAT_ROLES)}",
                              "messages")
        out.append({**m, "content": _content(m.get("content"), i)})
    return out


def _content(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages",
                                  "unsupported_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _ints(values: list[Any]) -> bool:
    """Every value an integer (not a bool); at C speed, as token-id lists are long."""
    return not values or set(map(type, values)) == {int}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(b: Mapping[str, Any], name: str, lo: int | None, hi: int | None) -> int | None:
    value = b.get(name)
    if value is None:
        return None
    if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = "" if lo is None else f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}"
        raise bad_request(f"{name} must be an integer{bounds}, got {value!r}", name)
    return value


def _opt_float(b: Mapping[str, Any], name: str) -> float | None:
    value = b.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _opt_bool(b: Mapping[str, Any], name: str, default: bool) -> bool:
    value = b.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value

