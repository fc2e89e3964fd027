"""What identifies an adapter's weights: a content hash of its PEFT files, and a
cheap file fingerprint (sizes and modification times) that says when the hash
must be recomputed; and the daemon's reader that computes them off the loop.

Torch-free. The functions block (they read the files, through
ipc/adapter_files.py: regular files inside the allowed directories only);
AdapterReader runs them on a few threads of its own with a deadline, so
neither the event loop nor the admin plane ever waits on a slow or hung file.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from loraplex.ipc.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    ADAPTER_WEIGHT_FILES,
    MAX_WEIGHTS_BYTES,
    AdapterFileError,
    open_adapter_file,
    weights_file_name,
)

_CHUNK = 1 << 20
READ_THREADS = 4  # reads in flight at once; a read stuck on a hung mount holds one until it returns
Fingerprint = tuple[tuple[str, int, int], ...]
T = TypeVar("T")


def adapter_fingerprint(path: str | Path) -> Fingerprint:
    """(file, size, mtime_ns) of the config and the weights file the engine reads, where they exist;
    changes when a file is rewritten (or a safetensors file appears beside a .bin)."""
    found = []
    for name in (ADAPTER_CONFIG, weights_file_name(path)):
        try:
            st = (Path(path) / name).stat()
        except OSError:
            continue
        found.append((name, st.st_size, st.st_mtime_ns))
    return tuple(found)


def adapter_content_hash(path: str | Path, roots: tuple[str, ...] = ()) -> str:
    """SHA-256 over the adapter's config and the weights file the engine will read (names and bytes;
    adapter_model.safetensors before adapter_model.bin); '' when one does not exist (the loader
    then says what is missing). AdapterFileError when a file may not be opened (outside `roots`,
    not a regular file, a weights file over MAX_WEIGHTS_BYTES), OSError when it cannot be read.
    A .bin is only hashed here: the engine loads it with torch's restricted unpickler and checks it."""
    digest = hashlib.sha256()
    try:
        for name in (ADAPTER_CONFIG, weights_file_name(path)):
            digest.update(name.encode() + b"\0")
            limit = None if name == ADAPTER_CONFIG else MAX_WEIGHTS_BYTES
            with open_adapter_file(path, name, roots, max_bytes=limit) as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
    except FileNotFoundError:
        return ""
    return digest.hexdigest()


def fingerprint_to_text(fingerprint: Fingerprint) -> str:
    """The registry's stored form of a fingerprint."""
    return ";".join(f"{name}:{size}:{mtime}" for name, size, mtime in fingerprint)


def fingerprint_from_text(text: str) -> Fingerprint:
    """Inverse of fingerprint_to_text; () for anything malformed (the files are then re-read)."""
    found = []
    for part in filter(None, (text or "").split(";")):
        name, _, rest = part.partition(":")
        size, _, mtime = rest.partition(":")
        if name not in (*ADAPTER_FILES, *ADAPTER_WEIGHT_FILES) or not size.isdigit() or not mtime.lstrip("-").isdigit():
            return ()
        found.append((name, int(size), int(mtime)))
    return tuple(found)


class AdapterReader:
    """Fingerprints and content hashes of adapter directories, computed on at most READ_THREADS
    daemon threads, each call bounded by `timeout_s` (waiting for a thread included). Every failure
    is an AdapterFileError whose `code` is a wire error code and whose message never quotes the
    files. Daemon threads: one stuck on a hung mount never holds up the daemon's exit."""

    def __init__(self, roots: tuple[str, ...], timeout_s: float) -> None:
        self.roots = roots
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(READ_THREADS)

    async def fingerprint(self, path: str) -> Fingerprint:
        return await self.run(adapter_fingerprint, path)

    async def identify(self, path: str) -> tuple[Fingerprint, str]:
        """(fingerprint, content hash) of the adapter at `path`, fingerprint taken first so a rewrite
        during the hash shows up as a changed fingerprint later."""
        return await self.run(self._identify, path)

    def _identify(self, path: str) -> tuple[Fingerprint, str]:
        return adapter_fingerprint(path), adapter_content_hash(path, self.roots)

    async def run(self, fn: Callable[[str], T], path: str) -> T:
        """`fn(path)` on a read thread within the deadline; what it raises is raised here (OSError
        as AdapterFileError)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._late(path, "every adapter read thread is busy") from None
        future: asyncio.Future = loop.create_future()

        def finish(outcome: tuple[object, BaseException | None]) -> None:
            self._slots.release()
            if not future.done():
                value, error = outcome
                future.set_exception(error) if error is not None else future.set_result(value)

        def work() -> None:
            try:
                outcome: tuple[object, BaseException | None] = (fn(path), None)
            except BaseException as exc:  # delivered to the awaiting coroutine
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(finish, outcome)
            except RuntimeError:
                pass  # the loop is gone (the daemon stopped meanwhile)

        threading.Thread(target=work, name="adapter-read", daemon=True).start()
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise self._late(path, "a hung filesystem?") from None
        except FileNotFoundError as exc:
            missing = os.path.basename(exc.filename or "") or "a file"
            raise AdapterFileError(f"adapter directory {path} has no {missing}") from None
        except OSError as exc:
            raise AdapterFileError(f"cannot read the files of adapter directory {path}: {exc.strerror}") from None

    def _late(self, path: str, why: str) -> AdapterFileError:
        return AdapterFileError(f"the files of adapter directory {path} could not be read within "
                                f"{self.timeout_s:g} s ({why}; server.adapter_read_timeout_s)")
