"""/v1/completions and /v1/chat/completions: parse the body, pick the
adapter from `model`, run the generations, answer with one JSON body or a
server-sent event stream (`data: {...}` chunks, then `data: [DONE]`).

A failure before the first byte gets its HTTP status; one after it (the
stream already said 200) is sent as a final `data: {"error": ...}` event.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from loraplex.gateway.chat_template import ChatTemplateError
from loraplex.gateway.errors import ApiError, bad_request, from_daemon, from_protocol
from loraplex.gateway.generation import Job
from loraplex.gateway.openai_format import ChatFormat, CompletionFormat, Envelope, Tokens, usage
from loraplex.gateway.prompt_logprobs import PromptAsk, echo_tokens, first_top_null, joined, vllm_prompt_logprobs
from loraplex.gateway.schema import ChatRequest, CompletionRequest, Prompt, Sampling
from loraplex.gateway.state import STATE, GatewayState
from loraplex.ipc.client import GenerateResult
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_closing: set[asyncio.Future[None]] = set()  # Job.close() calls outliving a cancelled handler


@dataclass(slots=True)
class Outcome:
    """What the request counter records for one HTTP request."""

    model: str = ""  # the resolved model id; empty while unknown
    outcome: str = "success"
    complete: bool = False  # the whole answer was handed to aiohttp; a later disconnect is no abort


Handler = Callable[[web.Request, GatewayState, Outcome], Awaitable[web.StreamResponse]]


def counted(endpoint: str, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`handler` as an aiohttp handler that counts its request once, whatever happens."""

    async def handle(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        out = Outcome()
        try:
            response = await handler(request, state, out)
        except ApiError as exc:
            out.outcome = exc.code or "error"
            raise
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            if not out.complete:
                out.outcome = "abort"
            raise
        except Exception:
            out.outcome = "internal"
            raise
        finally:
            state.metrics.request(endpoint, out.model, out.outcome)
        return response

    return handle


async def json_body(request: web.Request, endpoint: str = "json") -> Any:
    """The request's JSON body as the endpoint's parser makes it (json_decode.PARSERS); a large
    body is parsed off the event loop (gateway/body.py)."""
    return await request.app[STATE].bodies.json(request, endpoint)


async def completions(request: web.Request, state: GatewayState, out: Outcome) -> web.StreamResponse:
    req: CompletionRequest = await json_body(request, "completions")
    echoes = [await _prompt_text(state, p) for p in req.prompts] if req.echo else None
    return await _generate(request, state, out, CompletionFormat(req.tokens_as_ids), req.model, req.prompts,
                           req.sampling, stream=req.stream, include_usage=req.include_usage, echoes=echoes,
                           ask=req.prompt)


async def _prompt_text(state: GatewayState, prompt: Prompt) -> str:
    """What `echo` puts before a completion: the prompt's text (token ids decoded by the daemon)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return await state.client.detokenize(prompt)
    except LoraplexError as exc:
        raise from_daemon(exc) from None
    except ProtocolError as exc:
        raise from_protocol(exc) from None


async def chat_completions(request: web.Request, state: GatewayState, out: Outcome) -> web.StreamResponse:
    req: ChatRequest = await json_body(request, "chat")
    try:
        prompt = state.chat_template.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                            extra=req.template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    return await _generate(request, state, out, ChatFormat(req.tokens_as_ids), req.model, [prompt], req.sampling,
                           stream=req.stream, include_usage=req.include_usage)


async def _generate(request: web.Request, state: GatewayState, out: Outcome, fmt: CompletionFormat | ChatFormat,
                    requested: str | None, prompts: Sequence[Prompt], sampling: Sampling, *, stream: bool,
                    include_usage: bool, echoes: list[str] | None = None,
                    ask: PromptAsk = PromptAsk()) -> web.StreamResponse:
    model, adapter = state.resolve_model(requested)
    job = Job(state.client, state.metrics, model=model, adapter=adapter, prompts=prompts, sampling=sampling,
              timeout=state.config.request_timeout_s)
    try:
        await job.start()
    except LoraplexError as exc:
        if exc.code is not ErrorCode.UNKNOWN_ADAPTER:
            out.model = model
        raise from_daemon(exc, model) from None
    except ProtocolError as exc:
        out.model = model
        raise from_protocol(exc) from None
    out.model = model
    envelope = Envelope.new(fmt, model)
    try:
        if echoes and sampling.n > 1:  # one per choice
            echoes = [text for text in echoes for _ in range(sampling.n)]
        choices = len(prompts) * sampling.n
        if stream:
            return await _stream(request, job, envelope, choices, sampling.logprobs, include_usage, out, echoes)
        return await _collect(job, envelope, choices, sampling.logprobs, echoes, ask)
    finally:
        # Shielded: a disconnect cancels this handler, but the daemon must still hear the cancels.
        closing = asyncio.ensure_future(job.close())
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)
        await asyncio.shield(closing)


async def _collect(job: Job, env: Envelope, n: int, logprobs: bool, echoes: list[str] | None,
                   ask: PromptAsk = PromptAsk()) -> web.Response:
    tokens = [Tokens() for _ in range(n)] if logprobs else None
    try:
        async with aclosing(job.events()) as events:
            async for index, chunk in events:
                if tokens is not None:
                    tokens[index].extend(chunk.text, len(chunk.token_ids), chunk.logprobs, chunk.top_logprobs,
                                         chunk.token_ids)
    except LoraplexError as exc:
        raise from_daemon(exc, job.model) from None
    if ask.alternatives is None and ask.generate:
        choices = [env.fmt.choice(i, (echoes[i] if echoes else "") + c.text, c.finish_reason,
                                  tokens[i] if tokens is not None else None)
                   for i, c in enumerate(job.choices)]
        return web.json_response(env.body(choices, _usage(job.results)))
    results = job.results
    per_prompt = n // max(1, len(results))
    choices = [_scored_choice(env, i, c.text, c.finish_reason, tokens[i] if tokens is not None else None,
                              echoes[i] if echoes else "", ask, results[i // per_prompt])
               for i, c in enumerate(job.choices)]
    return web.json_response(env.body(choices, _usage(results, generated=ask.generate)))


def _scored_choice(env: Envelope, index: int, text: str, reason: str, tokens: Tokens | None, echo: str,
                   ask: PromptAsk, result: GenerateResult) -> dict[str, object]:
    """A choice of a request that asked for its prompt's logprobs (echo with logprobs, vLLM's
    prompt_logprobs) or for the prompt alone (max_tokens 0: the generated token is dropped)."""
    if not ask.generate:
        text, reason, tokens = "", "length", Tokens() if tokens is not None else None
    scored = result.prompt_logprobs
    if ask.alternatives is not None and scored is None:
        raise ApiError(500, "the daemon answered without the prompt's logprobs", code="internal")
    if ask.echo_logprobs is not None:
        tokens = joined(echo_tokens(scored, ask.echo_logprobs), tokens)
    choice = env.fmt.choice(index, echo + text, reason, tokens)
    if ask.echo_logprobs is not None:
        first_top_null(choice["logprobs"])
    if ask.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(scored, ask.prompt_logprobs)
    return choice


async def _stream(request: web.Request, job: Job, env: Envelope, n: int, logprobs: bool, include_usage: bool,
                  out: Outcome, echoes: list[str] | None) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)

    async def send(obj: object) -> None:
        await response.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    offsets = [0] * n
    try:
        try:
            for i in range(n):
                if (opening := env.fmt.opening(i)) is not None:
                    await send(env.chunk([opening], with_usage_key=include_usage))
                if echoes and echoes[i]:
                    await send(env.chunk([env.fmt.delta(i, echoes[i], None, 0)], with_usage_key=include_usage))
                    offsets[i] = len(echoes[i])
            async with aclosing(job.events()) as events:
                async for index, chunk in events:
                    if not chunk.text and not (logprobs and chunk.token_ids):
                        continue  # the detokenizer held this token's text back; a later chunk brings it
                    tokens = None
                    if logprobs:
                        tokens = Tokens()
                        tokens.extend(chunk.text, len(chunk.token_ids), chunk.logprobs, chunk.top_logprobs,
                                         chunk.token_ids)
                    await send(env.chunk([env.fmt.delta(index, chunk.text, tokens, offsets[index])],
                                         with_usage_key=include_usage))
                    offsets[index] += len(chunk.text)
            for i, choice in enumerate(job.choices):
                await send(env.chunk([env.fmt.closing(i, choice.finish_reason)], with_usage_key=include_usage))
            if include_usage:
                await send(env.chunk([], _usage(job.results)))
        except LoraplexError as exc:
            error = from_daemon(exc, job.model)
            out.outcome = error.code or "error"
            await send(error.body())
        out.complete = True
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; closing the job cancels what is left
        out.outcome = "abort"
    return response


def _usage(results: Sequence[GenerateResult], generated: bool = True) -> dict[str, object]:
    return usage(sum(r.usage.get("prompt_tokens", 0) for r in results),
                 sum(r.usage.get("completion_tokens", 0) for r in results) if generated else 0,
                 sum(r.usage.get("cached_tokens", 0) for r in results))
