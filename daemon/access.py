"""Who may reach the daemon, and what a client over TCP may see.

Owns the file modes of the daemon's Unix sockets (admin.sock stricter than client.sock and
stats.sock, optionally opened to server.admin_group), the start-up warning for a TCP listener
without CURVE, and the redaction of server file paths from the replies TCP clients get. Never
opens sockets; never touches token text (model output is the client's, whatever it says).
"""
from __future__ import annotations

import grp
import logging
import os
import re
from pathlib import Path
from typing import Any

from loraplex.daemon.config import ServerSettings
from loraplex.daemon.config_names import is_loopback_endpoint
from loraplex.ipc.protocol import AdaptersReply, ErrorReply, Message, StatsReply
from loraplex.ipc.runtime_dir import GROUP_ENTER_MODE, Endpoints

log = logging.getLogger("loraplex.daemon")

CLIENT_SOCKET_MODE = 0o660  # client.sock, stats.sock: the daemon's group, where the runtime directory lets it in
ADMIN_SOCKET_MODE = 0o600  # admin.sock: the daemon's user only
ADMIN_GROUP_MODE = 0o660  # admin.sock with server.admin_group: that group too
REDACTED = "<path>"
# An absolute (or home) path inside a string: a slash not preceded by a word character, ':', '/',
# '.' or '-' (so "tokens/s" and "tcp://host" stay), up to the next space or quote, not counting
# the punctuation that ends a clause ("cannot read /x/y: ...").
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.-])~?/[^\s'\"`]*[^\s'\"`:,;.)\]]")


class AccessError(RuntimeError):
    """The socket access the configuration asks for cannot be set up (unknown group, not a member)."""


def set_socket_modes(eps: Endpoints, runtime_dir: Path, admin_group: str | None) -> None:
    """After binding: client and stats sockets 0660, admin.sock 0600, or 0660 with `admin_group`
    as its group and the runtime directory 0710 with that group (so its members can enter).
    Each change loosens a file bound 0600 in a 0700 directory: nobody gets in early."""
    client, admin, stats = (Path(e[len("ipc://"):]) for e in (eps.client, eps.admin, eps.stats))
    os.chmod(client, CLIENT_SOCKET_MODE)
    os.chmod(stats, CLIENT_SOCKET_MODE)
    if admin_group is None:
        os.chmod(admin, ADMIN_SOCKET_MODE)
        os.chmod(runtime_dir, 0o700)  # a group opened by an earlier run is closed again
        return
    try:
        gid = grp.getgrnam(admin_group).gr_gid
    except KeyError:
        raise AccessError(f"server.admin_group: there is no group {admin_group!r}") from None
    try:
        os.chown(admin, -1, gid)
        os.chown(runtime_dir, -1, gid)
    except PermissionError:
        raise AccessError(f"server.admin_group: the daemon's user is not a member of group {admin_group!r}, "
                          "so it cannot give admin.sock to that group") from None
    os.chmod(admin, ADMIN_GROUP_MODE)
    os.chmod(runtime_dir, GROUP_ENTER_MODE)
    log.info("admin.sock: group %s may use it (mode %o)", admin_group, ADMIN_GROUP_MODE)


def warn_plain_tcp(server: ServerSettings) -> None:
    """A TCP listener without CURVE: loud when other hosts can reach it (server.tcp_insecure)."""
    if server.tcp_listen is None or server.tcp_curve_secret_key_file is not None:
        return
    if is_loopback_endpoint(server.tcp_listen):
        log.info("%s has no CURVE: every local user can generate and read stats through it", server.tcp_listen)
    else:
        log.warning("server.tcp_insecure: %s has no CURVE keys; anyone who can reach it can generate and read "
                    "stats, unencrypted", server.tcp_listen)


def redact_for_remote(msg: Message) -> Message:
    """`msg` as a TCP client may see it: no server file path in adapter lists, stats or errors."""
    if isinstance(msg, AdaptersReply):
        return AdaptersReply(adapters=[{**_scrub(entry), "path": REDACTED} for entry in msg.adapters],
                             request_id=msg.request_id)
    if isinstance(msg, StatsReply):
        return StatsReply(stats=_scrub(msg.stats), request_id=msg.request_id)
    if isinstance(msg, ErrorReply):
        return ErrorReply(request_id=msg.request_id, code=msg.code, message=_scrub(msg.message))
    return msg


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(REDACTED, value)
    if isinstance(value, dict):
        return {_scrub(k): _scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v) for v in value]
    return value
