"""What identifies an adapter's weights: a content hash of its PEFT files, and a
cheap file fingerprint (sizes and modification times) that says when the hash
must be recomputed.

Torch-free and blocking (it reads the files): the daemon calls it through
asyncio.to_thread so its event loop never waits on the disk.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_CHUNK = 1 << 20


def adapter_fingerprint(path: str | Path) -> tuple[tuple[str, int, int], ...]:
    """(file, size, mtime_ns) of each adapter file that exists; changes when a file is rewritten."""
    found = []
    for name in ADAPTER_FILES:
        try:
            st = (Path(path) / name).stat()
        except OSError:
            continue
        found.append((name, st.st_size, st.st_mtime_ns))
    return tuple(found)


def adapter_content_hash(path: str | Path) -> str:
    """SHA-256 over the adapter's files (names and bytes); '' when a file cannot be read."""
    digest = hashlib.sha256()
    try:
        for name in ADAPTER_FILES:
            digest.update(name.encode() + b"\0")
            with open(Path(path) / name, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
    except OSError:
        return ""
    return digest.hexdigest()
