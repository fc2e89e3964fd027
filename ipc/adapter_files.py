"""Opening an adapter's files safely, for every process that reads them.

Owns which files an adapter consists of and the one way they are opened: the
real path (symlinks resolved) must lie inside an allowed directory when the
operator named some (`server.adapter_dirs`), only a regular file is opened
(checked with stat first and again on the descriptor, opened O_NONBLOCK so a
FIFO swapped in meanwhile cannot block the open), sizes are bounded before
anything is read, and errors name the file but never quote its bytes. Also
checks a safetensors header without torch: bounded, every tensor floating
point, every extent inside the file. A pickled adapter_model.bin is only
bounded here (the engine loads it with torch's restricted unpickler). Stdlib only; the daemon calls it from a
thread with a deadline (a hung mount still blocks the thread, never the loop).
"""
from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Iterator

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"  # PEFT's pickled format (save_pretrained(safe_serialization=False))
ADAPTER_WEIGHT_FILES = (ADAPTER_WEIGHTS, ADAPTER_BIN)  # in order of preference when both exist
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # a safetensors adapter's files (its content hash covers these)
MAX_WEIGHTS_BYTES = 8 << 30  # one weights file: a rank-256 all-module adapter of a 70B model is ~3.3 GB in fp32
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes
MAX_HEADER_BYTES = 16 << 20  # a 128-layer, 7-module adapter's header is ~0.3 MB
MAX_TENSORS = 1 << 16
# safetensors dtype -> bytes per element; adapter weights must be one of these (floating point).
FLOAT_DTYPES: dict[str, int] = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_SHOWN = 160  # at most this many characters of a tensor name in an error


class AdapterFileError(ValueError):
    """An adapter file may not or cannot be read. `code` is a wire error code:
    `forbidden_path` (outside the allowed directories) or `invalid_adapter`."""

    def __init__(self, message: str, code: str = "invalid_adapter") -> None:
        super().__init__(message)
        self.code = code


def resolve_roots(roots: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    """The allowed directories with `~` expanded and symlinks resolved (what files are checked against)."""
    return tuple(os.path.realpath(os.path.expanduser(os.fspath(root))) for root in roots)


def allow_also(roots: tuple[str, ...], dirs: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    """`roots` plus `dirs` (the built-in demo's own adapters); empty `roots` (anywhere) stays empty."""
    return tuple(dict.fromkeys(roots + resolve_roots(dirs))) if roots else roots


def _inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots)


def adapter_file(directory: str | os.PathLike[str], name: str, roots: tuple[str, ...] = ()) -> str:
    """The real path of `directory/name`, if it may be opened: inside `roots` (resolved; empty =
    anywhere) and a regular file. Never opens it. FileNotFoundError when it does not exist."""
    shown = f"{name} of adapter directory {os.fspath(directory)}"
    real = os.path.realpath(os.path.join(os.fspath(directory), name))
    if roots and not _inside(real, roots):
        raise AdapterFileError(f"{shown} resolves outside the allowed adapter directories (server.adapter_dirs); "
                               "a symlink may not point out of them", code="forbidden_path")
    info = os.stat(real)  # never blocks on a FIFO (only opening one does)
    if not stat.S_ISREG(info.st_mode):
        raise AdapterFileError(f"{shown} is not a regular file (a FIFO, device or directory is never opened)")
    return real


@contextmanager
def open_adapter_file(directory: str | os.PathLike[str], name: str, roots: tuple[str, ...] = (), *,
                      max_bytes: int | None = None) -> Iterator[BinaryIO]:
    """`directory/name` opened for reading, checked as adapter_file() says, then checked again on
    the descriptor (what was opened is a regular file inside `roots`, at most `max_bytes`)."""
    real = adapter_file(directory, name, roots)
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterFileError(f"{name} of adapter directory {os.fspath(directory)} was replaced by a "
                                   "non-regular file while it was opened")
        if roots:
            opened = _opened_path(fd)
            if opened is not None and not _inside(opened, roots):
                raise AdapterFileError(f"{name} of adapter directory {os.fspath(directory)} moved outside the "
                                       "allowed adapter directories while it was opened", code="forbidden_path")
        if max_bytes is not None and info.st_size > max_bytes:
            raise AdapterFileError(f"{name} of adapter directory {os.fspath(directory)} is {info.st_size} bytes; "
                                   f"at most {max_bytes} are read")
        os.set_blocking(fd, True)  # a regular file: reads are plain blocking reads
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def _opened_path(fd: int) -> str | None:
    """What the descriptor refers to (Linux /proc); None where unknown."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def read_adapter_config(directory: str | os.PathLike[str], roots: tuple[str, ...] = ()) -> dict:
    """adapter_config.json as a JSON object (AdapterFileError when missing, too big or not an object)."""
    try:
        with open_adapter_file(directory, ADAPTER_CONFIG, roots, max_bytes=MAX_CONFIG_BYTES) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise AdapterFileError(f"{os.fspath(directory)} has no {ADAPTER_CONFIG}") from None
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise AdapterFileError(f"{ADAPTER_CONFIG} of {os.fspath(directory)} is not valid JSON{where}") from None
    if not isinstance(value, dict):
        raise AdapterFileError(f"{ADAPTER_CONFIG} of {os.fspath(directory)} must hold a JSON object")
    return value


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


def check_safetensors(f: BinaryIO, size: int, what: str) -> dict[str, TensorInfo]:
    """The tensors of the safetensors file open as `f` (`size` bytes), checked: a bounded header,
    floating-point dtypes only, every extent inside the file and of the size its shape says.
    AdapterFileError names `what` and the offending tensor, never quoting the file."""
    bad = f"cannot read {what}: not a valid safetensors file"
    if size < 8:
        raise AdapterFileError(f"{bad} (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise AdapterFileError(f"{bad} (its header length is out of bounds; at most {MAX_HEADER_BYTES} bytes "
                               "within the file are accepted)")
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AdapterFileError(f"{bad} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterFileError(f"{bad} (its header is not a JSON object)")
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise AdapterFileError(f"{what} holds {len(header)} tensors; at most {MAX_TENSORS} are accepted")
    data_size = size - 8 - length
    tensors: dict[str, TensorInfo] = {}
    for key, spec in header.items():
        shown = key[:_SHOWN]
        if not isinstance(spec, dict):
            raise AdapterFileError(f"{bad} (the entry of tensor {shown!r} is not an object)")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if dtype not in FLOAT_DTYPES:
            kind = repr(dtype)[:16] if isinstance(dtype, str) else "no dtype"
            raise AdapterFileError(f"{what}: tensor {shown!r} has dtype {kind}; adapter tensors must be floating "
                                   f"point ({', '.join(FLOAT_DTYPES)})")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise AdapterFileError(f"{bad} (tensor {shown!r} has a malformed shape)")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise AdapterFileError(f"{bad} (tensor {shown!r} has malformed data offsets)")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_size or end - begin != numel * FLOAT_DTYPES[dtype]:
            raise AdapterFileError(f"{bad} (tensor {shown!r} lies outside the file or does not match its shape)")
        tensors[key] = TensorInfo(dtype=dtype, shape=tuple(shape), begin=begin, end=end)
    return tensors


def weights_file_name(directory: str | os.PathLike[str]) -> str:
    """The adapter's weights file: adapter_model.safetensors when it exists (a symlink counts),
    else adapter_model.bin when that does, else adapter_model.safetensors (which then is missing)."""
    for name in ADAPTER_WEIGHT_FILES:
        if os.path.lexists(os.path.join(os.fspath(directory), name)):
            return name
    return ADAPTER_WEIGHTS


def read_safetensors_header(directory: str | os.PathLike[str], roots: tuple[str, ...] = ()) -> dict[str, TensorInfo]:
    """The checked tensor table of the adapter's weights file (check_safetensors), reading only its header."""
    try:
        with open_adapter_file(directory, ADAPTER_WEIGHTS, roots, max_bytes=MAX_WEIGHTS_BYTES) as f:
            return check_safetensors(f, os.fstat(f.fileno()).st_size, f"{ADAPTER_WEIGHTS} of {os.fspath(directory)}")
    except FileNotFoundError:
        raise AdapterFileError(f"{os.fspath(directory)} has no {ADAPTER_WEIGHTS}") from None
