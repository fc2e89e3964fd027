"""The console's panels, one module each, as pure View -> Rich renderers.

HEALTH is the strip across the top; PANELS fill the grid in this order (the last,
the in-flight request list, spans the whole width).
Nothing here imports Textual, zmq, torch or numpy.
"""
from __future__ import annotations

from loraplex.tui.panels import cache, engines, health, inflight, pcie, queues, requests, workers
from loraplex.tui.panels.base import PanelSpec, plain_text

HEALTH = health.PANEL
PANELS: tuple[PanelSpec, ...] = (requests.PANEL, queues.PANEL, cache.PANEL, pcie.PANEL, workers.PANEL,
                                 engines.PANEL, inflight.PANEL)

__all__ = ["HEALTH", "PANELS", "PanelSpec", "plain_text"]
