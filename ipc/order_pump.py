"""An executor's socket on its own thread: orders are received, decoded and prepared, and
replies encoded and sent, while the executor's thread runs the order before.

With the daemon one step ahead (scheduler.overlap), the next step's plan is already on the
socket when a step ends; decoding it and expanding its delta (`prepare`) then happen while
the step runs, not between two steps, and so does encoding the reply. The thread owns the
socket once started; it sleeps in a poll on the socket and a wake-up pipe, so an idle
executor costs nothing. Starting it shortens the interpreter's thread switch interval
(SWITCH_INTERVAL_S): the executor's thread, done with a step, must not wait the default 5 ms
for the GIL while the pump encodes the reply. Torch-free.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Callable

import zmq

from loraplex.ipc.codec import decode
from loraplex.ipc.errors import ProtocolError
from loraplex.ipc.protocol import EngineShutdown, Message
from loraplex.ipc.sockets import TypedSocket

Prepare = Callable[[Message, int], object]  # (order, its frame's bytes) -> what the executor runs
SWITCH_INTERVAL_S = 2e-4


class OrderPump:
    def __init__(self, sock: TypedSocket, prepare: Prepare) -> None:
        self.sock = sock
        self.prepare = prepare
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._pump, name="order-pump", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> OrderPump:
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread.start()
        return self

    def next(self) -> object:
        """The next prepared order (blocks); EngineShutdown when the daemon asked to stop."""
        item = self._inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def serve(self, begin: Callable[[object], object], run: Callable[[object], Message]) -> None:
        """Carry out orders until EngineShutdown: `begin(order)` readies one (cheap), `run(...)` runs
        it and returns its reply. A reply goes out once the next order has begun when that order
        is already here, so that encoding it never delays the next step's start."""
        reply: Message | None = None
        while True:
            try:
                order = self._inbox.get_nowait()
            except queue.Empty:
                if reply is not None:
                    self.reply(reply)
                    reply = None
                order = self._inbox.get()
            if isinstance(order, BaseException):
                raise order
            if isinstance(order, EngineShutdown):
                if reply is not None:
                    self.reply(reply)
                return
            ready = begin(order)
            if reply is not None:
                self.reply(reply)
            reply = run(ready)

    def reply(self, msg: Message) -> None:
        """Queue a reply; the pump thread encodes and sends it."""
        self._outbox.put(msg)
        os.write(self._wake_w, b"r")

    def stop(self) -> None:
        """Send what is queued, then end the thread (the socket is the caller's again)."""
        if self._thread.is_alive():
            self._outbox.put(None)
            os.write(self._wake_w, b"s")
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _pump(self) -> None:
        raw = self.sock.socket
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    while not self._outbox.empty():
                        msg = self._outbox.get()
                        if msg is None:
                            return
                        self.sock.send(msg)
                if raw in ready:
                    while raw.poll(0, zmq.POLLIN):
                        frame = raw.recv_multipart()[-1]
                        try:
                            msg = decode(frame, self.sock.limits.decode)
                        except ProtocolError as exc:  # the executor answers it as it answers a bad order
                            self._inbox.put(exc)
                            continue
                        self._inbox.put(msg if isinstance(msg, EngineShutdown) else self.prepare(msg, len(frame)))
        except BaseException as exc:  # the executor's thread re-raises it from next()
            self._inbox.put(exc)
