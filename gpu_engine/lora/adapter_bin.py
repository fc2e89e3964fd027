"""Reading a pickled `adapter_model.bin` without unpickling it freely.

Owns the one torch.load of an adapter: opened through ipc/adapter_files.py (allowed
directories, a regular file, at most MAX_WEIGHTS_BYTES), loaded with the restricted
weights_only unpickler (no code runs, no global outside torch's tensor allowlist) and
memory-mapped where the file is torch's zip format; the result must be a flat
{name: floating-point tensor} mapping. Names and shapes are checked by the caller.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from loraplex.errors import AdapterError
from loraplex.ipc.adapter_files import ADAPTER_BIN, MAX_TENSORS, MAX_WEIGHTS_BYTES, open_adapter_file

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ZIP_MAGIC = b"PK\x03\x04"
_SHOWN = 160


def load_adapter_bin(path: Path, roots: tuple[str, ...], label: str) -> dict[str, torch.Tensor]:
    """The tensors of `path`/adapter_model.bin: a flat mapping of floating-point CPU tensors.
    AdapterError (from ipc's AdapterFileError by the caller) when it may not be opened or is not that."""
    with open_adapter_file(path, ADAPTER_BIN, roots, max_bytes=MAX_WEIGHTS_BYTES) as f:
        zipped = f.read(4) == _ZIP_MAGIC
        f.seek(0)
        proc = f"/proc/self/fd/{f.fileno()}"
        # mmap needs a path: /proc/self/fd names the inode already opened and checked, so a file
        # swapped in meanwhile is never read. The legacy (pre-zip) format cannot be mapped.
        source: object = proc if zipped and os.path.exists(proc) else f
        try:
            loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=source is proc)
        except Exception as exc:  # the restricted unpickler refuses any global it does not allow
            raise AdapterError(f"adapter {label}: {ADAPTER_BIN} is not a pickled tensor state dict that torch's "
                               f"restricted (weights_only) loader accepts ({type(exc).__name__}); re-save it with "
                               "save_pretrained(safe_serialization=True)") from None
    return _tensors(loaded, label)


def _tensors(loaded: object, label: str) -> dict[str, torch.Tensor]:
    if not isinstance(loaded, Mapping):
        raise AdapterError(f"adapter {label}: {ADAPTER_BIN} holds a {type(loaded).__name__}, not a mapping of "
                           "tensor names to tensors")
    if len(loaded) > MAX_TENSORS:
        raise AdapterError(f"adapter {label}: {ADAPTER_BIN} holds {len(loaded)} entries; at most {MAX_TENSORS}")
    out: dict[str, torch.Tensor] = {}
    for key, value in loaded.items():
        shown = str(key)[:_SHOWN]
        if not isinstance(key, str):
            raise AdapterError(f"adapter {label}: {ADAPTER_BIN} has a {type(key).__name__} key; names must be strings")
        if not isinstance(value, torch.Tensor):
            raise AdapterError(f"adapter {label}: {ADAPTER_BIN} entry {shown!r} is a {type(value).__name__}, "
                               "not a tensor")
        if value.dtype not in _FLOATING:
            raise AdapterError(f"adapter {label}: {ADAPTER_BIN} tensor {shown!r} has dtype {value.dtype}; adapter "
                               "tensors must be floating point (float16, bfloat16, float32, float64)")
        out[key] = value
    return out
