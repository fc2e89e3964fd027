"""The engine caps glibc's malloc arenas, and quietly does nothing where it cannot."""
from __future__ import annotations

import ctypes
import platform

import pytest

from loraplex.gpu_engine import malloc_arenas


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_takes_the_arena_cap() -> None:
    assert malloc_arenas.bound_malloc_arenas(2) is True


def test_a_c_library_without_mallopt_is_a_no_op(monkeypatch) -> None:
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # e.g. musl: no mallopt symbol
    assert malloc_arenas.bound_malloc_arenas(2) is False


def test_a_c_library_that_does_not_open_is_a_no_op(monkeypatch) -> None:
    def refuse(name):
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert malloc_arenas.bound_malloc_arenas(2) is False
