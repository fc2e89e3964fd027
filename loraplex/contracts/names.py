"""The name rule of adapters (and of policies): what the wire protocol accepts, the
registry stores and the offline API takes. Safe in logs, file names and the console."""
from __future__ import annotations

import re

MAX_NAME_LEN = 128
NAME_RULE = f"1..{MAX_NAME_LEN} chars of [A-Za-z0-9._-] (not '.' or '..')"

_NAME = re.compile(r"[A-Za-z0-9._-]{1,%d}" % MAX_NAME_LEN)


def is_valid_name(name: object) -> bool:
    """True for a str that obeys NAME_RULE."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and name not in (".", "..")
