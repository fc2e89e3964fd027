"""All-or-nothing install of a demo directory, shared by the random and trained demos.

Owns the DONE marker protocol: write into a temporary sibling, rename into place,
DONE (holding the demo's version) last, so readers see a whole demo or none.
Never deletes a directory that is not a finished demo of some version.
"""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

DONE_MARKER = "DONE"


def marker(root: Path) -> str | None:
    """The version written in root/DONE, or None when there is none."""
    try:
        return (root / DONE_MARKER).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def ensure_installed(dest: Path, version: str, write: Callable[[Path], None], *, force: bool = False) -> Path:
    """Make `dest` a finished demo of `version`, calling `write(tmp_dir)` unless it already is one (or forced)."""
    dest = Path(dest).expanduser().absolute()
    if not force and marker(dest) == version:
        return dest
    _check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = dest.with_name(f".{dest.name}.tmp-{token}")
    try:
        tmp.mkdir()
        write(tmp)
        (tmp / DONE_MARKER).write_text(version + "\n")
        _install(tmp, dest, version, token, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _check_replaceable(dest: Path) -> None:
    """Refuse to replace anything but an empty dir or a finished demo (any version)."""
    if not dest.exists():
        return
    if not dest.is_dir():
        raise FileExistsError(f"{dest} exists and is not a directory")
    if marker(dest) is None and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty and holds no loraplex demo; refusing to overwrite it")


def _install(tmp: Path, dest: Path, version: str, token: str, *, force: bool) -> None:
    """Rename `tmp` onto `dest`; unless forced, a current demo installed meanwhile by a racing writer wins."""
    if not force and marker(dest) == version:
        return
    old = dest.with_name(f".{dest.name}.old-{token}")
    if marker(dest) is not None:
        # A finished demo (stale, or being forced): rename(2) cannot replace a
        # non-empty dir, so move it aside first. An empty dir is replaced directly.
        try:
            os.rename(dest, old)
        except FileNotFoundError:
            pass  # another process moved it away meanwhile
    try:
        os.rename(tmp, dest)
    except OSError:
        # Lost a race: dest reappeared non-empty. Fine if it is a finished demo.
        if marker(dest) != version:
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
