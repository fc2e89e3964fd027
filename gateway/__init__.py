"""The OpenAI-compatible HTTP gateway: a separate process that serves
/v1/completions, /v1/chat/completions, /v1/models, adapter load/unload and
/metrics as a client of the running daemon (one shared AsyncClient).

Built on aiohttp. Never imports torch, and never touches the daemon's
internals: everything goes through the client library's sockets.
"""
from __future__ import annotations

from loraplex.gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
