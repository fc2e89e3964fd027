"""vLLM's /tokenize and /detokenize (through the daemon's tokenizer, so the ids are
exactly those a prompt gets) and /version.

/tokenize takes a `prompt`, or chat `messages` rendered by the gateway's chat
template; the daemon bounds the text as it bounds prompts.
"""
from __future__ import annotations

from aiohttp import web

from loraplex import __version__
from loraplex.gateway.chat_template import ChatTemplateError
from loraplex.gateway.completions import json_body
from loraplex.gateway.errors import bad_request, from_daemon, from_protocol
from loraplex.gateway.schema import TokenizeRequest
from loraplex.gateway.state import STATE
from loraplex.ipc.errors import LoraplexError, ProtocolError

CONTROL_TIMEOUT_S = 30.0


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req: TokenizeRequest = await json_body(request, "tokenize")
    text = req.prompt
    if text is None:
        try:
            text = state.chat_template.render(req.messages, add_generation_prompt=req.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
    try:
        tokens = await state.client.tokenize(text, timeout=CONTROL_TIMEOUT_S)
    except LoraplexError as exc:
        raise from_daemon(exc) from None
    except ProtocolError as exc:
        raise from_protocol(exc) from None
    return web.json_response({"count": len(tokens.token_ids), "max_model_len": tokens.max_model_len,
                              "tokens": tokens.token_ids})


async def detokenize(request: web.Request) -> web.Response:
    ids: list[int] = await json_body(request, "detokenize")
    try:
        text = await request.app[STATE].client.detokenize(ids, timeout=CONTROL_TIMEOUT_S)
    except LoraplexError as exc:
        raise from_daemon(exc) from None
    except ProtocolError as exc:
        raise from_protocol(exc) from None
    return web.json_response({"prompt": text})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})
