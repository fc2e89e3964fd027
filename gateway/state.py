"""What every handler shares: the settings, the one AsyncClient (and admin
client) of the daemon, the metrics, the chat template, the body reader and the
connection guard, stored on the aiohttp application under STATE; and how
`model` picks the adapter.
"""
from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from loraplex.contracts.names import is_valid_name
from loraplex.gateway.body import Bodies
from loraplex.gateway.chat_template import ChatTemplate
from loraplex.gateway.config import GatewayConfig
from loraplex.gateway.connections import ConnectionGuard
from loraplex.gateway.errors import model_not_found
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.ipc.client import AsyncAdminClient, AsyncClient


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    client: AsyncClient
    admin: AsyncAdminClient | None  # None unless adapter admin is enabled
    metrics: GatewayMetrics
    chat_template: ChatTemplate
    bodies: Bodies  # every request body is read and decoded through it
    connections: ConnectionGuard

    def resolve_model(self, requested: str | None) -> tuple[str, str | None]:
        """(model id, adapter) for a request's `model`, as vLLM and LoRAX do:
        absent or the base name -> the base model (no adapter); anything else
        names an adapter, which the daemon confirms (unknown_adapter -> 404)."""
        base = self.config.served_model_name
        if requested is None or requested == base:
            return base, None
        if not is_valid_name(requested):
            raise model_not_found(requested)
        return requested, requested


STATE = web.AppKey("loraplex_gateway_state", GatewayState)
