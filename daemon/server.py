"""The daemon's sockets: one asyncio task per socket (client ROUTER, admin
ROUTER, optional tcp client ROUTER), a stats PUB publisher, and dispatch of
decoded messages into the serving core.

Never crashes on input: undecodable frames and refused requests are answered
with an `error` to that client only. Owns the runtime directory's socket
files while it runs and removes them on exit.
"""
from __future__ import annotations

import asyncio
import logging

from loraplex.daemon.access import redact_for_remote
from loraplex.daemon.adapter_changes import AdapterChanges
from loraplex.daemon.adapter_rules import RegistryError, check_adapter_path
from loraplex.daemon.registry import AdapterRegistry
from loraplex.daemon.serving import Rejected, ServingCore
from loraplex.ipc.adapter_files import AdapterFileError
from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.protocol import (
    AdaptersReply,
    AddAdapterRequest,
    AdminOkReply,
    CancelRequest,
    DetokenizedReply,
    DetokenizeRequest,
    DrainRequest,
    ErrorReply,
    GenerateRequest,
    ListAdaptersRequest,
    Message,
    PauseRequest,
    PinAdapterRequest,
    PingRequest,
    PongReply,
    RemoveAdapterRequest,
    SetPolicyRequest,
    StatsReply,
    StatsRequest,
    TokenizedReply,
    TokenizeRequest,
)
from loraplex.ipc.sockets import AsyncTypedSocket, PeerUnavailable

log = logging.getLogger("loraplex.daemon")
_ADMIN_ONLY = (AddAdapterRequest, RemoveAdapterRequest, PinAdapterRequest, DrainRequest, SetPolicyRequest,
               PauseRequest)
# Admin orders that await files or child processes: each runs as its own task (at most this many at
# once; the socket is read again once one finishes), the others are answered in order at once.
_SLOW_ADMIN = (AddAdapterRequest, RemoveAdapterRequest)
# Client requests answered from a tokenizer thread: likewise their own tasks, so ping and cancel never wait.
_SLOW_CLIENT = (TokenizeRequest, DetokenizeRequest)
MAX_CONCURRENT_ADMIN_ORDERS = 32


class Listener:
    """A ROUTER socket with a one-byte tag, so identities from different sockets never collide.
    `remote`: a TCP listener, whose clients never see server file paths."""

    def __init__(self, tag: int, sock: AsyncTypedSocket, admin: bool, remote: bool = False) -> None:
        self.tag = tag
        self.sock = sock
        self.admin = admin
        self.remote = remote


class Dispatcher:
    def __init__(self, core: ServingCore, registry: AdapterRegistry, allowed_roots: tuple[str, ...],
                 listeners: list[Listener], on_drain) -> None:
        self.core = core
        self.registry = registry
        self.changes = AdapterChanges(core, registry)  # the registry and the core change together
        self.allowed_roots = allowed_roots
        self.listeners = {lst.tag: lst for lst in listeners}
        self.on_drain = on_drain

    async def send(self, identity: bytes, msg: Message) -> None:
        """Reply to a tagged identity; a vanished peer becomes ConnectionError for the core."""
        listener = self.listeners[identity[0]]
        if listener.remote:
            msg = redact_for_remote(msg)
        try:
            await listener.sock.send(msg, identity=identity[1:])
        except PeerUnavailable as exc:
            raise ConnectionError(str(exc)) from None

    async def serve(self, listener: Listener) -> None:
        orders: set[asyncio.Task] = set()  # admin orders that wait on files or children, answered when done
        slots = asyncio.Semaphore(MAX_CONCURRENT_ADMIN_ORDERS)
        try:
            while True:
                try:
                    envelope = await listener.sock.recv()
                except ProtocolError as err:
                    if err.identity is not None:
                        await self._reply(bytes([listener.tag]) + err.identity, ErrorReply.from_error(err))
                    continue
                identity = bytes([listener.tag]) + (envelope.identity or b"")
                if (listener.admin and isinstance(envelope.message, _SLOW_ADMIN)) \
                        or isinstance(envelope.message, _SLOW_CLIENT):
                    # One slow add (a big or unreadable adapter) must never hold up list, ping or drain.
                    await slots.acquire()
                    task = asyncio.create_task(self._answer(listener, identity, envelope.message),
                                               name=f"admin-{envelope.message.TYPE}")
                    orders.add(task)
                    task.add_done_callback(lambda t: (orders.discard(t), slots.release()))
                    continue
                await self._answer(listener, identity, envelope.message)
                # A backlog of queued messages is received without suspending (the futures are
                # already done): yield, so the step loops stream tokens between a flood's messages.
                await asyncio.sleep(0)
        finally:
            for task in orders:
                task.cancel()

    async def _answer(self, listener: Listener, identity: bytes, msg: Message) -> None:
        try:
            reply = await self.handle(listener, identity, msg)
        except Rejected as exc:
            reply = ErrorReply(request_id=getattr(msg, "request_id", None), code=exc.code, message=exc.message[:4000])
        except Exception as exc:  # a bug must not take the daemon down; the client learns of it
            log.exception("internal error handling %s", msg.TYPE)
            reply = ErrorReply(request_id=getattr(msg, "request_id", None),
                               code=ErrorCode.INTERNAL.value, message=f"internal error: {exc}"[:4000])
        if reply is not None:
            await self._reply(identity, reply)

    async def _reply(self, identity: bytes, msg: Message) -> None:
        try:
            await self.send(identity, msg)
        except ConnectionError:
            await self.core.client_gone(identity)

    async def handle(self, listener: Listener, identity: bytes, msg: Message) -> Message | None:
        if isinstance(msg, GenerateRequest):
            await self.core.submit(identity, msg)
            return None
        if isinstance(msg, TokenizeRequest):
            ids = await self.core.tokenize(identity, msg.prompt)
            return TokenizedReply(request_id=msg.request_id, token_ids=ids, max_model_len=self.core.max_model_len)
        if isinstance(msg, DetokenizeRequest):
            return DetokenizedReply(request_id=msg.request_id, text=await self.core.detokenize(msg.token_ids))
        if isinstance(msg, CancelRequest):
            if not await self.core.cancel(identity, msg.request_id):
                raise Rejected(ErrorCode.NOT_FOUND, f"no request {msg.request_id!r} in flight for this client")
            return None
        if isinstance(msg, ListAdaptersRequest):
            return AdaptersReply(adapters=self.core.adapter_list(), request_id=msg.request_id)
        if isinstance(msg, StatsRequest):
            return StatsReply(stats=self.core.snapshot(), request_id=msg.request_id)
        if isinstance(msg, PingRequest):
            return PongReply(request_id=msg.request_id)
        if isinstance(msg, _ADMIN_ONLY):
            if not listener.admin:
                raise Rejected(ErrorCode.UNKNOWN_TYPE, f"{msg.TYPE} is an admin message: send it to the admin socket")
            return await self.handle_admin(msg)
        raise Rejected(ErrorCode.UNKNOWN_TYPE, f"the daemon does not accept {msg.TYPE} messages here")

    async def handle_admin(self, msg: Message) -> Message:
        rid = getattr(msg, "request_id", None)
        try:
            if isinstance(msg, AddAdapterRequest):  # the path is resolved off the loop: it may sit on a slow mount
                path = str(await self.core.reader.run(lambda p: check_adapter_path(p, self.allowed_roots), msg.path))
                entry, changed = await self.changes.add(msg.name, path, replace=msg.replace)
                return AdminOkReply(detail={"adapter": entry.to_wire(resident=False, refs=0), "changed": changed},
                                    request_id=rid)
            if isinstance(msg, RemoveAdapterRequest):
                await self.changes.remove(msg.name)
                return AdminOkReply(detail={"removed": msg.name}, request_id=rid)
            if isinstance(msg, PinAdapterRequest):
                self.changes.pin(msg.name, msg.pinned)
                return AdminOkReply(detail={"adapter": msg.name, "pinned": msg.pinned}, request_id=rid)
            if isinstance(msg, DrainRequest):
                self.on_drain(msg.timeout_s)
                return AdminOkReply(detail={"draining": True, "timeout_s": msg.timeout_s}, request_id=rid)
            if isinstance(msg, SetPolicyRequest):
                if msg.kind == "scheduler":
                    self.core.set_policy(msg.name)
                elif msg.kind == "router":
                    self.core.set_router(msg.name)
                else:
                    self.core.set_cache_policy(msg.name)
                return AdminOkReply(detail={msg.kind: msg.name}, request_id=rid)
            if isinstance(msg, PauseRequest):
                self.core.set_paused(msg.paused)
                return AdminOkReply(detail={"paused": msg.paused}, request_id=rid)
        except RegistryError as exc:
            code = {"already_exists": ErrorCode.ALREADY_EXISTS, "not_found": ErrorCode.NOT_FOUND,
                    "forbidden_path": ErrorCode.FORBIDDEN_PATH}.get(exc.code, ErrorCode.INVALID_FIELD)
            raise Rejected(code, str(exc)) from None
        except AdapterFileError as exc:
            raise Rejected(exc.code, str(exc)) from None
        raise Rejected(ErrorCode.UNKNOWN_TYPE, f"unhandled admin message {msg.TYPE}")


async def probe_quiet_clients(dispatcher: Dispatcher, interval_s: float = 1.0) -> None:
    """Clients waiting on non-streamed requests get no message until `done`; an unsolicited
    pong (clients drop it) tells us within a second when such a client has gone, so its
    requests are aborted and their pages freed instead of computed for nobody."""
    while True:
        await asyncio.sleep(interval_s)
        quiet = {s.identity for s in dispatcher.core.requests.values() if not s.msg.stream}
        for identity in quiet:
            await dispatcher._reply(identity, PongReply(request_id=None))


async def publish_stats(core: ServingCore, pub: AsyncTypedSocket, interval_s: float) -> None:
    """The stats stream for the console: one snapshot every interval, never blocking."""
    while True:
        try:
            await pub.send(StatsReply(stats=core.snapshot()))
        except Exception as exc:  # a slow subscriber must never stall serving
            log.debug("stats publish skipped: %s", exc)
        await asyncio.sleep(interval_s)
