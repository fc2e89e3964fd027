"""The HTTP side of bench/abuse_gap.py: a `loraplex gateway` subprocess on a free loopback port,
a POST that keeps reading while it sends (so a body refused early is answered, not cut off by a
reset), and one streamed completion whose token events are timestamped.

Standard library only: what a plain HTTP client could send. Never parses more than a reply.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SEND_CHUNK = 1 << 20


class GatewayProcess:
    """`loraplex gateway --port 0` as a client of the daemon at `runtime_dir`; its log is kept."""

    def __init__(self, runtime_dir: Path, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "gateway", "--port", "0", "--runtime-dir", str(runtime_dir),
             *flags], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        ports: queue.Queue[int] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(ports,), daemon=True)
        self._reader.start()
        try:
            self.port = ports.get(timeout=90)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"the gateway did not start:\n{self.log()}") from None

    def _read(self, ports: queue.Queue[int]) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if found := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
                ports.put(int(found[1]))

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9
        finally:
            self._reader.join(10)
            self.proc.stderr.close()


def post(port: int, path: str, body: bytes, timeout: float = 60.0) -> dict[str, Any]:
    """POST `body` with its Content-Length, reading the reply while the body is still going out.

    Returns status (None when no reply came), the error code if the reply is an OpenAI error,
    seconds from connecting to the whole reply, bytes of the body sent by then, and the send's
    error if the server closed before taking it all (expected when it refuses a body early)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    started = time.monotonic()
    sent, send_error = [0], [None]
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError as exc:
        return {"status": None, "code": None, "error": f"connect: {exc!r}", "seconds": 0.0, "bytes_sent": 0}

    def send() -> None:
        try:
            sock.sendall(head)
            view = memoryview(body)
            for offset in range(0, len(body), SEND_CHUNK):
                chunk = view[offset:offset + SEND_CHUNK]
                sock.sendall(chunk)
                sent[0] = offset + len(chunk)
        except OSError as exc:
            send_error[0] = type(exc).__name__

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    reply, error = b"", None
    try:
        reply = _read_reply(sock)
    except OSError as exc:
        error = f"read: {exc!r}"
    answered = time.monotonic()
    bytes_sent = sent[0]
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a sender still blocked in sendall
    sender.join(timeout)
    sock.close()
    status, payload = _parse(reply)
    code = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        code = payload["error"].get("code")
    return {"status": status, "code": code, "error": error, "seconds": round(answered - started, 3),
            "bytes_sent": bytes_sent, "send_error": send_error[0],
            "message": payload["error"].get("message", "")[:200] if code is not None else None}


def _read_reply(sock: socket.socket) -> bytes:
    """One whole HTTP reply: up to its Content-Length, or to the end of the connection."""
    data = b""
    while True:
        if b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if length and len(rest) >= int(length[1]):
                return data
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def _parse(reply: bytes) -> tuple[int | None, Any]:
    if not reply.startswith(b"HTTP/"):
        return None, None
    head, _, rest = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(rest)
    except ValueError:
        return status, None


class SseStream(threading.Thread):
    """One streamed completion through the gateway; the arrival time of each token event.

    logprobs 0: every token is an event, also one whose text the detokenizer holds back."""

    def __init__(self, port: int, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                     "stream": True, "logprobs": 0}
        self.times: list[float] = []
        self.status: int | None = None
        self.error: str | None = None
        self.ended: float | None = None  # when the stream ended on its own (not closed here)
        self.started = threading.Event()
        self._closing = False
        self._sock: socket.socket | None = None

    def run(self) -> None:
        try:
            self.conn.request("POST", "/v1/completions", json.dumps(self.body), {"Content-Type": "application/json"})
            self._sock = self.conn.sock  # http.client may drop it (a reply that will close) while reading on
            response = self.conn.getresponse()
            self.status = response.status
            if response.status != 200:
                self.error = response.read()[:300].decode(errors="replace")
                return
            while line := response.readline():
                if line.startswith(b'data: {"error"'):
                    self.error = line[6:306].decode(errors="replace")
                elif line.startswith(b"data: {"):
                    self.times.append(time.monotonic())
                    self.started.set()
            if not self._closing:
                self.ended = time.monotonic()
        except (OSError, AttributeError, ValueError, http.client.HTTPException) as exc:
            if not self._closing:  # closing here drops http.client's file: AttributeError/ValueError
                self.error = repr(exc)
                self.ended = time.monotonic()
        finally:
            self.started.set()

    def close(self) -> None:
        self._closing = True
        if self._sock is not None:  # wakes the reader at once, also between two events
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.join(30)

    def gaps_s(self, since: float, until: float) -> list[float]:
        """Gaps between tokens in [since, until], the window's ends counting as tokens: a stream
        stalled until the window closes shows the stall."""
        times = [since, *(t for t in self.times if since < t < until), until]
        return [b - a for a, b in zip(times, times[1:])]
