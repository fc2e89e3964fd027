"""How the bench tests run a script: in the environment a user has, not the suite's.

conftest.py sets LORAPLEX_DEMO=random for the whole suite (daemons started without
--model serve the parity fixture). A bench script run under it would never notice
that it depends on that choice, so the tests take it out: each script must choose
the model it needs itself.
"""
from __future__ import annotations

import os

SUITE_ONLY = ("LORAPLEX_DEMO",)  # what conftest sets for the suite and a user's shell has not


def user_env(**extra: str) -> dict[str, str]:
    """os.environ without the suite's own choices, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
    env.update(extra)
    return env
