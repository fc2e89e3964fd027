"""/v1/models (the base model and each adapter as a model whose parent is
the base, as vLLM lists LoRA modules), vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter through the daemon's admin socket, and /health.

The admin routes exist only when adapter admin is enabled (otherwise the
router answers 404, as vLLM without runtime LoRA updating does).
"""
from __future__ import annotations

import os
import time

from aiohttp import web

from loraplex.gateway.completions import json_body
from loraplex.gateway.errors import ApiError, bad_request, from_daemon, model_not_found
from loraplex.gateway.state import STATE, GatewayState
from loraplex.ipc.client import AdapterInfo, AsyncAdminClient, LoraplexError

OWNER = "loraplex"
CONTROL_TIMEOUT_S = 10.0
ADAPTER_LOAD_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 2.0


def _card(model_id: str, created: int, *, root: str, parent: str | None) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNER, "root": root,
            "parent": parent, "permission": []}


async def _adapters(state: GatewayState) -> list[AdapterInfo]:
    try:
        adapters = await state.client.adapters(timeout=CONTROL_TIMEOUT_S)
    except LoraplexError as exc:
        raise from_daemon(exc) from None
    return [a for a in adapters if a.state != "error"]  # a failed adapter cannot serve requests


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    base, created = state.config.served_model_name, int(time.time())
    cards = [_card(base, created, root=base, parent=None)]
    cards += [_card(a.name, created, root=a.path, parent=base) for a in await _adapters(state)
              if a.name != base]
    return web.json_response({"object": "list", "data": cards})


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    base, created = state.config.served_model_name, int(time.time())
    wanted = request.match_info["model"]
    if wanted == base:
        return web.json_response(_card(base, created, root=base, parent=None))
    for adapter in await _adapters(state):
        if adapter.name == wanted:
            return web.json_response(_card(adapter.name, created, root=adapter.path, parent=base))
    raise model_not_found(wanted)


def _string_field(body: object, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string", name)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_body(request)
    name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
    if name == state.config.served_model_name:
        raise bad_request(f"{name!r} is the base model's name", "lora_name")
    # The daemon resolves paths in its own working directory: send an absolute one (a URI, which
    # the cluster's ingress accepts, e.g. s3://bucket/prefix/NAME, is passed as given).
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
    try:
        await _admin(state).add_adapter(name, path, timeout=ADAPTER_LOAD_TIMEOUT_S)
    except LoraplexError as exc:
        raise from_daemon(exc) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = _string_field(await json_body(request), "lora_name")
    try:
        await _admin(state).remove_adapter(name, timeout=CONTROL_TIMEOUT_S)
    except LoraplexError as exc:
        error = from_daemon(exc)
        if error.status == 404:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", code="not_found",
                           param="lora_name") from None
        raise error from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _admin(state: GatewayState) -> AsyncAdminClient:
    if state.admin is None:  # the routes are not registered then; kept as a guard
        raise ApiError(404, "adapter administration is disabled", code="not_found")
    return state.admin


async def health(request: web.Request) -> web.Response:
    """200 while the daemon answers a ping, else 503."""
    try:
        await request.app[STATE].client.ping(timeout=HEALTH_TIMEOUT_S)
    except LoraplexError as exc:
        raise from_daemon(exc) from None
    return web.Response(status=200)
