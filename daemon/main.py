"""`loraplex serve` / `loraplexd`: run the daemon in the foreground until
SIGTERM or SIGINT, then drain in-flight requests and exit 0.

Owns process-level setup: runtime directory, sockets, registry, the engine
link, signal handling and clean removal of socket files.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sqlite3
import time
import sys
from typing import Callable

import zmq.asyncio

from loraplex.daemon.access import AccessError, set_socket_modes, warn_plain_tcp
from loraplex.daemon.cache_link import CacheManagerLink
from loraplex.daemon.config import LoraplexConfig
from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.adapter_hash import fingerprint_from_text, fingerprint_to_text
from loraplex.daemon.adapter_table import AdapterEntry
from loraplex.daemon.model_scope import ModelScopeError, model_scope
from loraplex.daemon.registry import AdapterRecord, AdapterRegistry, RegistryError, check_adapter_path
from loraplex.daemon.sdnotify import Notifier
from loraplex.daemon.server import Dispatcher, Listener, probe_quiet_clients, publish_stats
from loraplex.daemon.replicas import build_router
from loraplex.daemon.serving import ServingCore
from loraplex.ipc.codec import DecodeLimits
from loraplex.ipc.curve import CurveError, load_server_keys, start_authenticator
from loraplex.ipc.runtime_dir import endpoints, ensure_runtime_dir, instance_id
from loraplex.ipc.shm import sweep_stale
from loraplex.ipc.socket_options import SocketLimits
from loraplex.ipc.sockets import make_pub, make_router

log = logging.getLogger("loraplex.daemon")
EXIT_DRAIN_TIMEOUT = 3  # the drain timed out: requests in flight were failed (they are logged)
DRAIN_LOG_LIMIT = 32  # requests named in that log line


def register_startup_adapters(config: LoraplexConfig, registry: AdapterRegistry) -> None:
    """Adapters named by --adapter or the config file join the durable registry."""
    for name, path in config.adapters:
        resolved = str(check_adapter_path(path, config.server.adapter_dirs))
        registry.add(name, resolved, source="flag", replace=True)


async def run_daemon(config: LoraplexConfig, *, ready: asyncio.Event | None = None,
                     engine_factory: Callable[..., EngineLink] = EngineLink,
                     reload_config: Callable[[], LoraplexConfig] | None = None) -> int:
    """Serve until stopped. `engine_factory` is EngineLink's signature; tests and the
    overhead benchmark inject a stub there to measure the control plane alone."""
    try:
        build_router(config.scheduler.router, config.scheduler)  # e.g. rank_aware's profile file
    except (OSError, ValueError) as exc:
        log.error("cannot start router %s: %s", config.scheduler.router, exc)
        return 2
    try:
        scope = model_scope(config.model.model)
    except ModelScopeError as exc:
        log.error("cannot serve the model: %s", exc)
        return 2
    runtime_dir = ensure_runtime_dir(config.server.resolved_runtime_dir)
    eps = endpoints(runtime_dir)
    registry = AdapterRegistry(config.server.registry_path, model=scope)
    log.info("adapter registry %s, scope %s (this base model's adapters only)", config.server.registry_path, scope)
    try:
        register_startup_adapters(config, registry)
    except (RegistryError, ValueError) as exc:
        log.error("cannot register startup adapters: %s", exc)
        registry.close()
        return 2
    ctx = zmq.asyncio.Context()
    size = config.server.max_message_bytes
    limits = SocketLimits(decode=DecodeLimits(max_message_bytes=size, max_str_len=size, max_bin_len=size))
    sockets: list = []
    zap = None  # the CURVE key allow-list of the tcp listener, when configured
    try:
        listeners = [Listener(0, make_router(ctx, eps.client, limits=limits), admin=False)]
        sockets.append(listeners[-1].sock)
        listeners.append(Listener(1, make_router(ctx, eps.admin, limits=limits), admin=True))
        sockets.append(listeners[-1].sock)
        if config.server.tcp_listen:
            try:
                curve = load_server_keys(config.server.tcp_curve_secret_key_file, config.server.tcp_curve_allowed_keys)
            except CurveError as exc:
                log.error("cannot serve %s with CURVE: %s", config.server.tcp_listen, exc)
                return 2
            zap = start_authenticator(ctx, curve)
            listeners.append(Listener(2, make_router(ctx, config.server.tcp_listen, limits=limits, curve=curve),
                                      admin=False, remote=True))
            sockets.append(listeners[-1].sock)
            warn_plain_tcp(config.server)
        pub = make_pub(ctx, eps.stats, limits=limits)
        sockets.append(pub)
        try:
            set_socket_modes(eps, runtime_dir, config.server.admin_group)
        except AccessError as exc:
            log.error("%s", exc)
            return 2
        spec = {**dataclasses.asdict(config.model), "shm_instance": instance_id(runtime_dir),
                "max_num_seqs": config.scheduler.max_num_seqs,  # the largest decode batch: the largest graph
                "adapter_dirs": list(config.server.adapter_dirs)}  # children check every adapter file too
        engines = [engine_factory(ctx, runtime_dir, {**spec, "replica": i}, index=i,
                                  start_timeout_s=config.server.engine_start_timeout_s,
                                  step_timeout_s=config.server.engine_step_timeout_s,
                                  heartbeat_timeout_s=config.server.heartbeat_timeout_s,
                                  spare=config.server.spare_children)
                   for i in range(config.server.engines)]
        # The host tier's process; a stub engine factory (tests, the overhead bench) runs without one.
        cache = CacheManagerLink(ctx, runtime_dir, spec, start_timeout_s=config.server.engine_start_timeout_s,
                                 step_timeout_s=config.server.engine_step_timeout_s,
                                 heartbeat_timeout_s=config.server.heartbeat_timeout_s,
                                 spare=config.server.spare_children) \
            if engine_factory is EngineLink else None
        swept = sweep_stale()
        if swept:
            log.info("removed %d stale shared-memory segments of dead daemons", len(swept))
        return await _serve(config, registry, listeners, pub, engines, eps, ready, ctx, runtime_dir, reload_config,
                            cache)
    finally:
        for sock in sockets:
            sock.close()
        if zap is not None:
            zap.stop()
        ctx.term()
        registry.close()
        sweep_stale()  # segments of an engine that was killed rather than stopped
        log.info("stopped")


async def _serve(config: LoraplexConfig, registry: AdapterRegistry, listeners: list[Listener], pub,
                 engines: list[EngineLink], eps, ready: asyncio.Event | None, engine_ctx, runtime_dir,
                 reload_config: Callable[[], LoraplexConfig] | None = None,
                 cache: CacheManagerLink | None = None) -> int:
    stop = asyncio.Event()
    drain_budget = [config.server.drain_timeout_s]

    def request_stop(timeout_s: float | None = None) -> None:
        if timeout_s is not None:
            drain_budget[0] = timeout_s
        stop.set()

    dispatcher: Dispatcher | None = None

    def make_cpu_pool():
        from loraplex.cpu_lora.pool import CpuWorkerPool

        return CpuWorkerPool(engine_ctx, runtime_dir, num_workers=config.server.cpu_workers,
                             heartbeat_timeout_s=config.server.heartbeat_timeout_s)

    core = ServingCore(config, engines, send=lambda ident, msg: dispatcher.send(ident, msg),
                       make_cpu_pool=make_cpu_pool, cache=cache)
    dispatcher = Dispatcher(core, registry, config.server.adapter_dirs, listeners, on_drain=request_stop)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop)
    notifier = Notifier()
    reloading: list[asyncio.Task] = []

    def request_reload() -> None:
        if not reloading or reloading[-1].done():
            reloading.append(asyncio.ensure_future(reload(core, registry, notifier, reload_config)))

    loop.add_signal_handler(signal.SIGHUP, request_reload)
    tasks: list[asyncio.Task] = []
    try:
        log.info("starting %s (model: %s)", "the engine" if len(engines) == 1 else f"{len(engines)} engines",
                 config.model.model or "built-in demo")
        notifier.status("loading the model")
        notifier.extend_timeout(config.server.engine_start_timeout_s + 30)
        core.on_identified = lambda e: registry.record_identity(e.name, e.content_hash,
                                                                fingerprint_to_text(e.fingerprint))
        try:
            await core.start([_entry_of(r) for r in registry.list()])
        except (EngineDied, EngineRefused) as exc:
            log.error("the engine could not start: %s", exc)
            return 1
        tasks = [asyncio.create_task(dispatcher.serve(lst), name=f"listener-{lst.tag}") for lst in listeners]
        tasks.append(asyncio.create_task(publish_stats(core, pub, config.server.stats_interval_s), name="stats"))
        tasks.append(asyncio.create_task(probe_quiet_clients(dispatcher), name="probe"))
        tasks.append(asyncio.create_task(notifier.watchdog(core.engines_alive), name="watchdog"))
        tasks.append(asyncio.create_task(claim_unscoped(core, registry), name="claim-unscoped"))
        log.info("serving on %s (admin %s, stats %s)%s", eps.client, eps.admin, eps.stats,
                 f", {config.server.tcp_listen}" if config.server.tcp_listen else "")
        names = [e.name for e in core.adapters.entries() if e.state != "error"]
        log.info("ready: %d adapters (%s). Try: loraplex generate --stream --adapter %s 'Once upon a time'",
                 len(names), ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""), names[0] if names else "NAME")
        notifier.ready(f"serving {len(names)} adapters on {eps.client}")
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("stopping: draining in-flight requests (up to %.0f s)", drain_budget[0])
        notifier.stopping(f"draining {len(core.requests)} requests")
        if not await core.drain(drain_budget[0]):
            left = [(state.request_id, state.msg.adapter) for state in core.requests.values()]
            shown = ", ".join(f"{rid} ({adapter or 'base'})" for rid, adapter in left[:DRAIN_LOG_LIMIT])
            log.error("drain timed out after %.0f s; failing %d requests still in flight: %s%s", drain_budget[0],
                      len(left), shown, " ..." if len(left) > DRAIN_LOG_LIMIT else "")
            return EXIT_DRAIN_TIMEOUT
        return 0
    finally:
        # The signal handlers stay installed: a second SIGTERM while draining must not kill us mid-cleanup.
        await core.stop()
        try:  # what was used this run orders the next start's warm-up
            registry.add_uses({e.name: e.requests for e in core.adapters.entries()})
        except sqlite3.Error as exc:
            log.warning("adapter use counts not saved: %s", exc)
        notifier.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def reload(core: ServingCore, registry: AdapterRegistry, notifier: Notifier,
                 reload_config: Callable[[], LoraplexConfig] | None) -> None:
    """SIGHUP: re-read the config and the registry without dropping requests (systemd RELOADING=1).
    Live-changeable: scheduler and cache policies, and the set of registered adapters."""
    notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
    try:
        if reload_config is not None:
            fresh = reload_config()
            register_startup_adapters(fresh, registry)
            core.set_policy(fresh.scheduler.policy)
            core.set_cache_policy(fresh.scheduler.cache_policy)
        await claim_unscoped(core, registry)
        demo = set(core.hello.demo_adapters) if core.hello else set()
        records = {r.name: r for r in registry.list()}
        for name, record in records.items():
            try:
                if name not in core.adapters:
                    await core.add_adapter(name, record.path, record.pinned)
                elif await core.files_changed(name, record.path):  # new path or rewritten files
                    _, changed = await core.replace_adapter(name, record.path)
                    if changed:
                        log.info("reload: adapter %s has new weights", name)
            except Exception as exc:  # one bad entry must not stop the reload
                log.warning("reload: adapter %s not added or replaced: %s", name, exc)
        for entry in core.adapters.entries():
            if entry.name not in records and entry.name not in demo:
                try:
                    await core.remove_adapter(entry.name)
                except Exception as exc:  # in use: it stays until a later reload
                    log.warning("reload: adapter %s not removed: %s", entry.name, exc)
        log.info("reloaded: %d adapters", len(core.adapters.entries()))
    except Exception as exc:
        log.error("reload failed, keeping the previous configuration: %s", exc)
    finally:
        notifier.ready(f"serving {len(core.adapters.entries())} adapters (reloaded)")


async def claim_unscoped(core: ServingCore, registry: AdapterRegistry) -> None:
    """Adapters registered before registries were scoped by base model (or by a tool naming no model)
    join this model's scope when their files load on it; the others stay for another model's daemon.
    Runs after ready, one adapter at a time, each read bounded by server.adapter_read_timeout_s."""
    claimed = 0
    for record in registry.unscoped():
        if record.name in core.adapters:
            continue  # this model has its own adapter of that name; the unscoped one stays
        try:
            fits = await core.fits_model(record.name, record.path)
        except (EngineDied, EngineRefused) as exc:
            log.warning("unscoped adapters not checked: %s", exc)
            return
        if not fits or record.name in core.adapters:
            continue
        claimed_record = registry.claim(record.name)
        if claimed_record is not None:
            core.adapters.put(_entry_of(claimed_record))
            if claimed_record.pinned:
                core.pin_adapter(claimed_record.name, True)
            claimed += 1
    if claimed:
        log.info("registry: %d adapters registered without a model scope load on this model; they are its own now",
                 claimed)


def _entry_of(record: AdapterRecord) -> AdapterEntry:
    """A registry row as the serving core's entry: not read yet, its recorded identity trusted while
    the files' sizes and mtimes stay the same."""
    return AdapterEntry(name=record.name, path=record.path, pinned=record.pinned, content_hash=record.content_hash,
                        fingerprint=fingerprint_from_text(record.fingerprint), uses=record.uses)


def serve(config: LoraplexConfig, reload_config: Callable[[], LoraplexConfig] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="loraplexd %(levelname)s %(message)s", stream=sys.stderr)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is a dependency; this only keeps odd platforms working
        runner = asyncio.run
    return runner(run_daemon(config, reload_config=reload_config))
