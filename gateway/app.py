"""The aiohttp application: routes, the OpenAI-style error middleware, the
lifecycle of the shared daemon clients, and `serve()` (listen until stopped).

One AsyncClient serves every HTTP request concurrently over one socket; it
is created and closed inside the server's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from loraplex.gateway import completions, models, tokens
from loraplex.gateway.body import MAX_BODY_BYTES, Bodies, longest_token_bytes
from loraplex.gateway.chat_template import ChatTemplate
from loraplex.gateway.config import GatewayConfig
from loraplex.gateway.connections import ConnectionGuard, GuardedSite
from loraplex.gateway.daemon_metrics import DaemonStats
from loraplex.gateway.errors import ApiError, from_daemon
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.gateway.state import STATE, GatewayState
from loraplex.ipc.client import AsyncAdminClient, AsyncClient, LoraplexError

log = logging.getLogger("loraplex.gateway")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SHUTDOWN_TIMEOUT_S = 10.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def connection_phases(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Tell the connection guard that a request's head is whole (no head deadline while it is
    served) and when it is done (the next head's deadline starts with its first byte)."""
    guard = request.app[STATE].connections
    guard.request_started(request.protocol)
    try:
        return await handler(request)
    finally:
        guard.request_ended(request.protocol)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes `{"error": {...}}` with its status."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except LoraplexError as exc:
        return from_daemon(exc).response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "not_found" if exc.status == 404 else exc.reason.lower().replace(" ", "_")
        return ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", code=code).response()
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return ApiError(500, "internal error in the gateway; see its log", code="internal").response()


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


def build_app(config: GatewayConfig, *, client: AsyncClient | None = None,
              admin: AsyncAdminClient | None = None) -> web.Application:
    """The gateway application; the daemon clients open when it starts. `client`/`admin`: objects
    with the same calls to use instead of the daemon's own sockets (the Ray cluster's ingress
    passes clients that reach its replicas); the app closes them on cleanup."""
    # Handlers read bodies through Bodies (its cap, deadline and decoder); client_max_size only
    # bounds aiohttp's own readers, should one be used.
    app = web.Application(middlewares=[connection_phases, openai_errors],
                          client_max_size=max(config.max_body_bytes or 0, MAX_BODY_BYTES))
    if client is None:
        client = AsyncClient(runtime_dir=config.runtime_dir)
    if admin is None and config.enable_adapter_admin:
        admin = AsyncAdminClient(runtime_dir=config.runtime_dir)
    if not config.enable_adapter_admin:
        admin = None
    stats = DaemonStats(lambda timeout: client.stats(timeout=timeout), timeout_s=config.stats_timeout_s,
                        cache_s=config.stats_cache_s)
    app[STATE] = GatewayState(config=config, client=client, admin=admin,
                              metrics=GatewayMetrics(stats, max_loras=config.max_loras),
                              chat_template=ChatTemplate.from_model_dir(config.model_dir),
                              bodies=Bodies(config, client, longest_token_bytes(config.model_dir)),
                              connections=ConnectionGuard(config))
    app.router.add_post("/v1/completions", completions.counted("completions", completions.completions))
    app.router.add_post("/v1/chat/completions", completions.counted("chat", completions.chat_completions))
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model}", models.retrieve_model)
    if config.enable_adapter_admin:
        app.router.add_post("/v1/load_lora_adapter", models.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", models.unload_lora_adapter)
    app.router.add_post("/tokenize", tokens.tokenize)
    app.router.add_post("/detokenize", tokens.detokenize)
    app.router.add_get("/version", tokens.version)
    app.router.add_get("/health", models.health)
    app.router.add_get("/metrics", metrics)
    app.on_cleanup.append(_close_clients)
    return app


async def _close_clients(app: web.Application) -> None:
    state = app[STATE]
    await state.bodies.close()
    await state.client.close()
    if state.admin is not None:
        await state.admin.close()


async def listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str, int]:
    """Start serving `app` on host:port (0 picks one); (runner, bound host, bound port). The caller
    owns the runner: `await runner.cleanup()` finishes in-flight responses and closes."""
    # handler_cancellation: a client that disconnects cancels its generation on the daemon.
    state = app[STATE]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                           keepalive_timeout=state.config.keepalive_timeout_s)
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, state.connections).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, bound_host, bound_port


async def serve(config: GatewayConfig, *, stop: asyncio.Event | None = None,
                on_listening: Callable[[str, int], None] | None = None) -> None:
    """Listen until `stop` is set (default: until SIGINT or SIGTERM), then
    finish in-flight responses (up to SHUTDOWN_TIMEOUT_S) and close.
    `on_listening(host, port)` is called once bound (port 0 picks one)."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    app = build_app(config)
    runner, host, port = await listen(app, config.host, config.port)
    try:
        log.info("serving the OpenAI API at http://%s:%d/v1 (daemon: %s)", host, port, app[STATE].client.endpoint)
        if on_listening is not None:
            on_listening(host, port)
        await stop.wait()
    finally:
        await runner.cleanup()
