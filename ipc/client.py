"""The loraplex client library: talk to a local daemon from Python.

    from loraplex.ipc.client import Client, AsyncClient

    with Client() as client:                      # finds the daemon via the runtime dir
        result = client.generate("Hello", adapter="qv-r8", max_tokens=32)
        for chunk in (stream := client.stream("Hello")):
            print(chunk.text, end="")
        print(stream.result.timings)              # set once the stream ended

Blocking classes live in client_sync (thread-safe), asyncio ones in
client_async (one socket, many concurrent requests); both only do the I/O.
What they share: every call's request, reply and checks (client_calls), the
I/O-free connection core (client_core) and the result types (client_types).
Every daemon-side or connection failure raises LoraplexError with a stable
ErrorCode. Never imports torch or numpy.
"""
from __future__ import annotations

from loraplex.ipc.client_async import AsyncAdminClient, AsyncClient, AsyncStream
from loraplex.ipc.client_sync import AdminClient, Client, Stream
from loraplex.ipc.client_types import (
    AdapterInfo,
    Choice,
    GenerateResult,
    Liveness,
    StreamChunk,
    Tokenized,
    new_request_id,
)
from loraplex.ipc.errors import ErrorCode, LoraplexError
from loraplex.ipc.guided import Guided
from loraplex.ipc.protocol import PromptLogprobs, TopLogprobs

__all__ = [
    "AdapterInfo",
    "AdminClient",
    "AsyncAdminClient",
    "AsyncClient",
    "AsyncStream",
    "Choice",
    "Client",
    "ErrorCode",
    "GenerateResult",
    "Guided",
    "Liveness",
    "LoraplexError",
    "PromptLogprobs",
    "Stream",
    "StreamChunk",
    "Tokenized",
    "TopLogprobs",
    "new_request_id",
]
