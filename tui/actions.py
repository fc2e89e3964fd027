"""Admin actions the console offers: what each asks for, how it is confirmed,
and which admin call it makes.

Owns the action table (add, remove, pin, unpin, policy, drain), the parsing
and validation of what the operator typed, and the call on an admin client.
Never talks to Textual (tui/modals.py asks the questions) and never sends
anything before the operator confirmed.
"""
from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.contracts.names import MAX_NAME_LEN, is_valid_name
from loraplex.ipc.protocol import MAX_DRAIN_TIMEOUT_S, POLICY_KINDS

Values = dict[str, Any]


class AdminApi(Protocol):
    """The part of loraplex.ipc.client.AsyncAdminClient the console uses."""

    async def add_adapter(self, name: str, path: str) -> dict[str, object]: ...
    async def remove_adapter(self, name: str) -> dict[str, object]: ...
    async def pin_adapter(self, name: str, pinned: bool = True) -> dict[str, object]: ...
    async def unpin_adapter(self, name: str) -> dict[str, object]: ...
    async def drain(self, timeout_s: float = 30.0) -> dict[str, object]: ...
    async def set_policy(self, kind: Any, name: str) -> dict[str, object]: ...
    async def adapters(self, *, timeout: float | None = ...) -> list[Any]: ...
    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Field:
    """One input of an action form. choices: a fixed set (a select);
    adapter: suggest registered adapter names; number: parse as float;
    name: must be a valid adapter/policy name on the wire."""

    key: str
    label: str
    placeholder: str = ""
    default: str = ""
    choices: tuple[str, ...] = ()
    adapter: bool = False
    number: bool = False
    name: bool = False


@dataclass(frozen=True, slots=True)
class AdminAction:
    """key: the binding; confirm(values): the question; call: the admin request;
    done(values, detail): what the operator is told afterwards."""

    key: str
    name: str
    title: str
    fields: tuple[Field, ...]
    confirm: Callable[[Values], str]
    call: Callable[[AdminApi, Values], Awaitable[dict[str, object]]]
    done: Callable[[Values, Mapping[str, object]], str]


def parse(action: AdminAction, raw: Mapping[str, str]) -> Values:
    """The typed values of a filled-in form; ValueError naming the field otherwise."""
    values: Values = {}
    for f in action.fields:
        text = str(raw.get(f.key, "")).strip()
        if not text:
            raise ValueError(f"{f.label} is required")
        if f.choices and text not in f.choices:
            raise ValueError(f"{f.label} must be one of {', '.join(f.choices)}")
        if f.number:
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"{f.label} must be a number of seconds") from None
            if not (math.isfinite(number) and 0 < number <= MAX_DRAIN_TIMEOUT_S):
                raise ValueError(f"{f.label} must be in (0, {MAX_DRAIN_TIMEOUT_S:g}]")
            values[f.key] = number
        elif f.name and not is_valid_name(text):
            raise ValueError(f"{f.label} must be 1..{MAX_NAME_LEN} characters of A-Z a-z 0-9 . _ -")
        elif f.key == "path":
            values[f.key] = os.path.abspath(os.path.expanduser(text))
        else:
            values[f.key] = text
    return values


NAME = Field("name", "Adapter", placeholder="adapter name", adapter=True, name=True)

ACTIONS: dict[str, AdminAction] = {
    a.name: a
    for a in (
        AdminAction(
            "a", "add", "Add adapter",
            (Field("name", "Adapter", placeholder="new adapter name", name=True),
             Field("path", "Path", placeholder="PEFT directory on the daemon's host")),
            confirm=lambda v: f"Register adapter {v['name']!r} from {v['path']}?",
            call=lambda admin, v: admin.add_adapter(v["name"], v["path"]),
            done=lambda v, d: f"added {v['name']}",
        ),
        AdminAction(
            "r", "remove", "Remove adapter", (NAME,),
            confirm=lambda v: f"Remove adapter {v['name']!r}? Requests already running with it finish first.",
            call=lambda admin, v: admin.remove_adapter(v["name"]),
            done=lambda v, d: f"removed {v['name']}",
        ),
        AdminAction(
            "p", "pin", "Pin adapter", (NAME,),
            confirm=lambda v: f"Pin adapter {v['name']!r} on the GPU (never evicted)?",
            call=lambda admin, v: admin.pin_adapter(v["name"], True),
            done=lambda v, d: f"pinned {v['name']}",
        ),
        AdminAction(
            "u", "unpin", "Unpin adapter", (NAME,),
            confirm=lambda v: f"Unpin adapter {v['name']!r} (evictable again)?",
            call=lambda admin, v: admin.unpin_adapter(v["name"]),
            done=lambda v, d: f"unpinned {v['name']}",
        ),
        AdminAction(
            "s", "policy", "Switch policy",
            (Field("kind", "Policy kind", default=POLICY_KINDS[0], choices=POLICY_KINDS),
             Field("name", "Policy name", placeholder="e.g. fcfs", name=True)),
            confirm=lambda v: f"Switch the {v['kind']} policy to {v['name']!r}?",
            call=lambda admin, v: admin.set_policy(v["kind"], v["name"]),
            done=lambda v, d: f"{v['kind']} policy is now {d.get(v['kind'], v['name'])}",
        ),
        AdminAction(
            "d", "drain", "Drain daemon",
            (Field("timeout_s", "Timeout (s)", default="30", number=True),),
            confirm=lambda v: f"Drain the daemon? It stops admitting requests and waits up to "
                              f"{v['timeout_s']:g} s for running ones, then shuts down.",
            call=lambda admin, v: admin.drain(v["timeout_s"]),
            done=lambda v, d: f"draining (up to {v['timeout_s']:g} s)",
        ),
    )
}
