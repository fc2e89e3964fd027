"""Shared-memory test helpers: unique segment names per test, and a check that
the test left nothing behind in /dev/shm (leftovers are removed, then reported)."""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")


class ShmNames:
    """Names `/lpx-test-<token>-<purpose>`, unique to one test."""

    def __init__(self) -> None:
        self.prefix = f"/lpx-test-{secrets.token_hex(4)}-"

    def __call__(self, purpose: str = "seg") -> str:
        return f"{self.prefix}{purpose}"

    def leftovers(self) -> list[str]:
        return sorted("/" + p.name for p in SHM_DIR.glob(f"{self.prefix[1:]}*"))


@pytest.fixture
def shm_names() -> Iterator[ShmNames]:
    names = ShmNames()
    yield names
    left = names.leftovers()
    for name in left:
        os.unlink(SHM_DIR / name[1:])
    assert not left, f"the test left shared-memory segments behind: {left}"
