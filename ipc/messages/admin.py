"""Requests and the success reply of the admin socket (console, operators).

Owns add/remove/pin adapter, drain, set_policy and pause, and `admin_ok`. Failures
are answered with the common `error` reply. Every admin request may carry a
`request_id`, echoed in its reply, because several can be in flight and some
(add, drain) finish out of order. Never performs the operation itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import FilePath, InInterval, Name, RequestId

MAX_DRAIN_TIMEOUT_S = 3600.0
PolicyKind = Literal["scheduler", "cache", "router"]
POLICY_KINDS: tuple[str, ...] = get_args(PolicyKind)


@register
@dataclass(frozen=True, slots=True)
class AddAdapterRequest(Message):
    """Register the adapter at `path` (absolute, on the daemon's host) as `name`; with `replace`,
    an adapter already called `name` gets the new weights (every cached copy is invalidated)."""

    TYPE = "add_adapter"

    name: Name
    path: FilePath
    request_id: RequestId | None = None
    replace: bool = False


@register
@dataclass(frozen=True, slots=True)
class RemoveAdapterRequest(Message):
    """Unregister `name`; requests already running with it finish first."""

    TYPE = "remove_adapter"

    name: Name
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class PinAdapterRequest(Message):
    """Pin (keep GPU-resident, never evict) or unpin `name`."""

    TYPE = "pin_adapter"

    name: Name
    pinned: bool = True
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class DrainRequest(Message):
    """Stop admitting requests and wait up to `timeout_s` for running ones."""

    TYPE = "drain"

    timeout_s: Annotated[float, InInterval(0.0, MAX_DRAIN_TIMEOUT_S, lo_open=True)] = 30.0
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class SetPolicyRequest(Message):
    """Switch the scheduling policy, the cache-eviction policy or the engine router to `name`."""

    TYPE = "set_policy"

    kind: PolicyKind
    name: Name
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class PauseRequest(Message):
    """Hold (`paused`) or resume scheduling: while held, requests are accepted and queue up, steps
    already running finish, and no new step starts (maintenance, or lining up a burst)."""

    TYPE = "pause"

    paused: bool = True
    request_id: RequestId | None = None


@register
@dataclass(frozen=True, slots=True)
class AdminOkReply(Message):
    """An admin request succeeded; `detail` says what happened (free-form)."""

    TYPE = "admin_ok"

    detail: dict[str, object] = field(default_factory=dict)
    request_id: RequestId | None = None
