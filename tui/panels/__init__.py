"""The console's panels, one module each, as pure View -> Rich renderers.

HEALTH is the strip across the top; PANELS fill the grid in this order.
Nothing here imports Textual, zmq, torch or numpy.
"""
from __future__ import annotations

from loraplex.tui.panels import cache, engines, health, pcie, queues, requests, workers
from loraplex.tui.panels.base import PanelSpec, plain_text

HEALTH = health.PANEL
PANELS: tuple[PanelSpec, ...] = (requests.PANEL, queues.PANEL, cache.PANEL, pcie.PANEL, workers.PANEL,
                                 engines.PANEL)

__all__ = ["HEALTH", "PANELS", "PanelSpec", "plain_text"]
