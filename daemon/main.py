"""`loraplex serve` / `loraplexd`: run the daemon in the foreground until
SIGTERM or SIGINT, then drain in-flight requests and exit 0.

Owns process-level setup: runtime directory, the state directory's lock (one
daemon per base model there), the registry (checked before it is opened), sockets,
the child process links, signal handling and clean removal of socket files.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Callable

import zmq.asyncio

from loraplex.daemon.access import AccessError, set_socket_modes, warn_plain_tcp
from loraplex.daemon.adapter_hash import fingerprint_to_text
from loraplex.daemon.adapter_rules import RegistryError
from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.cache_link import CacheManagerLink
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.grammar_link import GrammarWorkerLink
from loraplex.daemon.model_scope import ModelScopeError, model_scope
from loraplex.daemon.registry import AdapterRegistry, RegistrySchemaError, ensure_state_dir
from loraplex.daemon.registry_check import check_registry
from loraplex.daemon.reload import claim_unscoped, entry_of, register_startup_adapters, reload
from loraplex.daemon.replicas import build_router
from loraplex.daemon.sdnotify import Notifier
from loraplex.daemon.server import Dispatcher, Listener, probe_quiet_clients, publish_stats
from loraplex.daemon.serving import ServingCore
from loraplex.daemon.state_lock import StateLock
from loraplex.ipc.codec import DecodeLimits
from loraplex.ipc.curve import CurveError, load_server_keys, start_authenticator
from loraplex.ipc.runtime_dir import Endpoints, endpoints, ensure_runtime_dir, instance_id
from loraplex.ipc.shm import sweep_stale
from loraplex.ipc.socket_options import SocketLimits
from loraplex.ipc.sockets import make_pub, make_router

log = logging.getLogger("loraplex.daemon")
EXIT_DRAIN_TIMEOUT = 3  # the drain timed out: requests in flight were failed (they are logged)
DRAIN_LOG_LIMIT = 32  # requests named in that log line


class CannotStart(Exception):
    """The daemon cannot start as configured; the message says why (logged; exit status 2)."""


async def run_daemon(config: LoraplexConfig, *, ready: asyncio.Event | None = None,
                     engine_factory: Callable[..., EngineLink] = EngineLink,
                     reload_config: Callable[[], LoraplexConfig] | None = None) -> int:
    """Serve until stopped. `engine_factory` is EngineLink's signature; tests and the
    overhead benchmark inject a stub there to measure the control plane alone."""
    try:
        scope = _model_scope(config)
    except CannotStart as exc:
        log.error("%s", exc)
        return 2
    runtime_dir = ensure_runtime_dir(config.server.resolved_runtime_dir)
    eps = endpoints(runtime_dir)
    lock = StateLock.for_daemon(_state_dir(config), scope)  # StateDirLocked (an OSError): serve says whose
    try:
        registry = _open_registry(config, scope)
    except BaseException as exc:
        lock.release()
        if not isinstance(exc, CannotStart):
            raise
        log.error("%s", exc)
        return 2
    ctx = zmq.asyncio.Context()
    sockets = _Sockets()
    try:
        sockets.open(ctx, config, eps, runtime_dir)
        engines, cache = _child_links(ctx, runtime_dir, config, engine_factory)
        swept = sweep_stale()
        if swept:
            log.info("removed %d stale shared-memory segments of dead daemons", len(swept))
        return await _Daemon(config, registry, sockets, eps, ready, reload_config).serve(engines, cache, ctx,
                                                                                           runtime_dir)
    except CannotStart as exc:
        log.error("%s", exc)
        return 2
    finally:
        sockets.close()
        ctx.term()
        registry.close()
        sweep_stale()  # segments of an engine that was killed rather than stopped
        lock.release()  # last: the next daemon on this state directory may start now
        log.info("stopped")


def _state_dir(config: LoraplexConfig) -> Path:
    state_dir = config.server.resolved_state_dir
    ensure_state_dir(state_dir)
    return state_dir


def _open_registry(config: LoraplexConfig, scope: str) -> AdapterRegistry:
    """The registry (checked sound first, so a damaged file stops the start with one line and the way
    out) with the configured startup adapters registered; CannotStart when it cannot be."""
    path = config.server.registry_path
    report = check_registry(path)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        fix = "" if report.newer_schema else (
            "; `loraplex registry check` lists the problems, `loraplex registry repair` keeps a backup of the file "
            "and rewrites the entries that are still valid")
        raise CannotStart(f"adapter registry {path} cannot be used: {report.problems[0]}{more}{fix}")
    try:
        registry = AdapterRegistry(path, model=scope)
    except (sqlite3.Error, RegistrySchemaError) as exc:
        raise CannotStart(f"adapter registry {path} cannot be opened: {exc}") from None
    log.info("adapter registry %s, scope %s (this base model's adapters only)", path, scope)
    try:
        register_startup_adapters(config, registry)
    except (RegistryError, ValueError, sqlite3.Error) as exc:
        registry.close()
        raise CannotStart(f"cannot register startup adapters: {exc}") from None
    return registry


def _model_scope(config: LoraplexConfig) -> str:
    """The registry scope of the configured base model, once its router is known to start."""
    try:
        build_router(config.scheduler.router, config.scheduler)  # e.g. rank_aware's profile file
    except (OSError, ValueError) as exc:
        raise CannotStart(f"cannot start router {config.scheduler.router}: {exc}") from None
    try:
        return model_scope(config.model.model)
    except ModelScopeError as exc:
        raise CannotStart(f"cannot serve the model: {exc}") from None


class _Sockets:
    """The client and admin listeners (and the TCP one), the stats PUB socket and the CURVE key
    allow-list: opened together, closed together (also after a partial open)."""

    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self.pub = None
        self.zap = None  # the CURVE key allow-list of the tcp listener, when configured
        self._opened: list = []

    def open(self, ctx: zmq.asyncio.Context, config: LoraplexConfig, eps: Endpoints, runtime_dir) -> None:
        server = config.server
        size = server.max_message_bytes
        limits = SocketLimits(decode=DecodeLimits(max_message_bytes=size, max_str_len=size, max_bin_len=size))
        self._listen(Listener(0, make_router(ctx, eps.client, limits=limits), admin=False))
        self._listen(Listener(1, make_router(ctx, eps.admin, limits=limits), admin=True))
        if server.tcp_listen:
            try:
                curve = load_server_keys(server.tcp_curve_secret_key_file, server.tcp_curve_allowed_keys)
            except CurveError as exc:
                raise CannotStart(f"cannot serve {server.tcp_listen} with CURVE: {exc}") from None
            self.zap = start_authenticator(ctx, curve)
            self._listen(Listener(2, make_router(ctx, server.tcp_listen, limits=limits, curve=curve), admin=False,
                                  remote=True))
            warn_plain_tcp(server)
        self.pub = make_pub(ctx, eps.stats, limits=limits)
        self._opened.append(self.pub)
        try:
            set_socket_modes(eps, runtime_dir, server.admin_group)
        except AccessError as exc:
            raise CannotStart(str(exc)) from None

    def _listen(self, listener: Listener) -> None:
        self.listeners.append(listener)
        self._opened.append(listener.sock)

    def close(self) -> None:
        for sock in self._opened:
            sock.close()
        if self.zap is not None:
            self.zap.stop()


def _child_links(ctx: zmq.asyncio.Context, runtime_dir, config: LoraplexConfig,
                 engine_factory: Callable[..., EngineLink]) -> tuple[list[EngineLink], CacheManagerLink | None]:
    """One link per engine and, unless a stub engine factory stands in (tests, the overhead bench),
    the cache manager's; every child gets the same spec, built once from the configuration."""
    spec = config.engine_spec(instance_id(runtime_dir))
    server = config.server
    timeouts = {"start_timeout_s": server.engine_start_timeout_s, "step_timeout_s": server.engine_step_timeout_s,
                "heartbeat_timeout_s": server.heartbeat_timeout_s, "spare": server.spare_children}
    engines = [engine_factory(ctx, runtime_dir, spec, index=i, **timeouts) for i in range(server.engines)]
    cache = CacheManagerLink(ctx, runtime_dir, spec, **timeouts) if engine_factory is EngineLink else None
    return engines, cache


class _Daemon:
    """One run of the daemon: the serving core behind its sockets, the signals that stop or
    reload it, the background tasks, and the drain at the end."""

    def __init__(self, config: LoraplexConfig, registry: AdapterRegistry, sockets: _Sockets, eps: Endpoints,
                 ready: asyncio.Event | None, reload_config: Callable[[], LoraplexConfig] | None) -> None:
        self.config = config
        self.registry = registry
        self.sockets = sockets
        self.eps = eps
        self.ready = ready
        self.reload_config = reload_config
        self.stopping = asyncio.Event()
        self.drain_budget_s = config.server.drain_timeout_s
        self.notifier = Notifier()
        self.tasks: list[asyncio.Task] = []
        self._reloading: asyncio.Task | None = None

    def request_stop(self, timeout_s: float | None = None) -> None:
        if timeout_s is not None:
            self.drain_budget_s = timeout_s
        self.stopping.set()

    async def serve(self, engines: list[EngineLink], cache: CacheManagerLink | None, ctx, runtime_dir) -> int:
        config = self.config

        def make_cpu_pool():
            from loraplex.cpu_lora.pool import CpuWorkerPool

            return CpuWorkerPool(ctx, runtime_dir, num_workers=config.server.cpu_workers,
                                 heartbeat_timeout_s=config.server.heartbeat_timeout_s)

        def make_grammar_worker(index: int) -> GrammarWorkerLink:  # structured output's compiles (grammar_gate.py)
            server = config.server
            return GrammarWorkerLink(ctx, runtime_dir, config.engine_spec(instance_id(runtime_dir)), index=index,
                                     start_timeout_s=server.engine_start_timeout_s,
                                     heartbeat_timeout_s=server.heartbeat_timeout_s)

        self.core = ServingCore(config, engines, send=lambda ident, msg: self.dispatcher.send(ident, msg),
                                make_cpu_pool=make_cpu_pool, cache=cache,
                                make_grammar_worker=make_grammar_worker if cache is not None else None)
        self.dispatcher = Dispatcher(self.core, self.registry, config.server.adapter_dirs, self.sockets.listeners,
                                     on_drain=self.request_stop)
        self._install_signal_handlers()
        try:
            if not await self._start(len(engines)):
                return 1
            self._start_tasks()
            self._announce_ready()
            await self.stopping.wait()
            return await self._drain()
        finally:
            await self._shut_down()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)

    def _request_reload(self) -> None:
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.ensure_future(reload(self.core, self.registry, self.notifier,
                                                           self.reload_config))

    async def _start(self, num_engines: int) -> bool:
        core, registry = self.core, self.registry
        log.info("starting %s (model: %s)", "the engine" if num_engines == 1 else f"{num_engines} engines",
                 self.config.model.model or "built-in demo")
        self.notifier.status("loading the model")
        self.notifier.extend_timeout(self.config.server.engine_start_timeout_s + 30)
        core.identity.on_identified = self._record_identity
        try:
            await core.start([entry_of(r) for r in registry.list()])
        except (EngineDied, EngineRefused) as exc:
            log.error("the engine could not start: %s", exc)
            return False
        return True

    def _record_identity(self, entry: AdapterEntry) -> None:
        """What a lazy load read of the files: a cache for the next start, so serving never waits on it."""
        try:
            self.registry.record_identity(entry.name, entry.content_hash, fingerprint_to_text(entry.fingerprint))
        except sqlite3.Error as exc:
            log.warning("adapter %s: content hash not recorded in the registry: %s", entry.name, exc)

    def _start_tasks(self) -> None:
        core, dispatcher = self.core, self.dispatcher
        self.tasks = [asyncio.create_task(dispatcher.serve(lst), name=f"listener-{lst.tag}")
                      for lst in self.sockets.listeners]
        self.tasks += [
            asyncio.create_task(publish_stats(core, self.sockets.pub, self.config.server.stats_interval_s),
                                name="stats"),
            asyncio.create_task(probe_quiet_clients(dispatcher), name="probe"),
            asyncio.create_task(self.notifier.watchdog(core.engines_alive), name="watchdog"),
            asyncio.create_task(claim_unscoped(core, self.registry), name="claim-unscoped"),
        ]

    def _announce_ready(self) -> None:
        eps, tcp = self.eps, self.config.server.tcp_listen
        log.info("serving on %s (admin %s, stats %s)%s", eps.client, eps.admin, eps.stats, f", {tcp}" if tcp else "")
        names = [e.name for e in self.core.adapters.entries() if e.state != "error"]
        log.info("ready: %d adapters (%s). Try: loraplex generate --stream --adapter %s 'Once upon a time'",
                 len(names), ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""), names[0] if names else "NAME")
        self.notifier.ready(f"serving {len(names)} adapters on {eps.client}")
        if self.ready is not None:
            self.ready.set()

    async def _drain(self) -> int:
        core, budget = self.core, self.drain_budget_s
        log.info("stopping: draining in-flight requests (up to %.0f s)", budget)
        self.notifier.stopping(f"draining {len(core.requests)} requests")
        if await core.drain(budget):
            return 0
        left = [(state.request_id, state.msg.adapter) for state in core.requests.values()]
        shown = ", ".join(f"{rid} ({adapter or 'base'})" for rid, adapter in left[:DRAIN_LOG_LIMIT])
        log.error("drain timed out after %.0f s; failing %d requests still in flight: %s%s", budget, len(left), shown,
                  " ..." if len(left) > DRAIN_LOG_LIMIT else "")
        return EXIT_DRAIN_TIMEOUT

    async def _shut_down(self) -> None:
        # The signal handlers stay installed: a second SIGTERM while draining must not kill us mid-cleanup.
        await self.core.stop()
        try:  # what was used this run orders the next start's warm-up
            self.registry.add_uses({e.name: e.requests for e in self.core.adapters.entries()})
        except sqlite3.Error as exc:
            log.warning("adapter use counts not saved: %s", exc)
        self.notifier.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def serve(config: LoraplexConfig, reload_config: Callable[[], LoraplexConfig] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="loraplexd %(levelname)s %(message)s", stream=sys.stderr)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency; this only keeps odd platforms working
        runner = asyncio.run
    return runner(run_daemon(config, reload_config=reload_config))
