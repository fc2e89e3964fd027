"""The engine caps glibc's malloc arenas, and quietly does nothing where it cannot."""
from __future__ import annotations

import ctypes.util
import platform

import pytest

from loraplex.gpu_engine import malloc_arenas


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_takes_the_arena_cap() -> None:
    assert malloc_arenas.bound_malloc_arenas(2) is True


def test_no_c_library_found_is_a_no_op(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert malloc_arenas.bound_malloc_arenas(2) is False


def test_a_c_library_that_does_not_load_is_a_no_op(monkeypatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libloraplex-no-such-libc.so.6")
    assert malloc_arenas.bound_malloc_arenas(2) is False
