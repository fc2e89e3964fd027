"""What the panels draw from: the latest snapshot plus everything derived locally.

Owns the View value handed to every panel render function and the link state
vocabulary. Immutable and free of Textual, zmq and I/O, so a panel can be
rendered from a hand-written dict in a unit test.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from loraplex.tui.history import History


class Link(str, Enum):
    """State of the stats stream as the console sees it."""

    CONNECTING = "connecting"  # no snapshot yet and not yet given up waiting
    LIVE = "live"  # snapshots arriving
    DISCONNECTED = "disconnected"  # none for a while; the feed keeps reconnecting


@dataclass(frozen=True, slots=True)
class View:
    """stats: the latest snapshot ({} before the first). age_s: seconds since it
    arrived. adapters: the admin socket's adapter list (dicts as on the wire),
    None until fetched. admin_error: why the last admin poll failed, if it did."""

    stats: Mapping[str, Any] = field(default_factory=dict)
    history: History = field(default_factory=History)
    link: Link = Link.CONNECTING
    reason: str = ""
    target: str = ""
    age_s: float | None = None
    adapters: tuple[Mapping[str, Any], ...] | None = None
    admin_error: str | None = None

    @property
    def live(self) -> bool:
        return self.link is Link.LIVE
