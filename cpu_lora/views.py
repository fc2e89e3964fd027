"""Zero-copy torch views of the shared-memory segments a CPU worker reads and writes.

Owns attaching the activation exchange (read-write: the worker writes out
rows and done words) and the host adapter store (read-only), the tensors over
them, and noticing when a segment name was re-created by its owner. Never
copies weights: every A / Bᵀ block is a view into the store mapping.
"""
from __future__ import annotations

import errno
import os
import warnings

import torch

from loraplex.cpu_lora.compute import store_dtype
from loraplex.ipc.exchange import STAGES, ExchangeLayout
from loraplex.ipc.shm import HEADER_BYTES, SHM_DIR, Region, SharedSegment, ShmError


def segment_identity(name: str) -> bytes | None:
    """The owner header currently behind `name` (creator pid and time), None if unknown.

    A segment re-created under the same name (an engine restart) has a new
    header, while an old mapping still shows the old one."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name[1:]), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)


def _frombuffer(buf: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    with warnings.catch_warnings():
        # A read-only mapping makes torch warn that writes would be undefined; the
        # store views are only ever read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


class ExchangeViews:
    """x rows per stage ([max_tokens, in] float32) and out rows per module
    ([max_tokens, out] float32) of one exchange segment, plus its word buffer."""

    def __init__(self, layout: ExchangeLayout) -> None:
        self.layout = layout
        self.segment = layout.attach_segment()
        self.identity = bytes(self.segment.buf[:HEADER_BYTES])
        self.words = self.segment.buf  # what loraplex._C's word functions take
        self.x = [self._view(layout.x_region(stage)) for stage in range(len(STAGES))]
        self.out = {m: self._view(layout.out_region(m)) for m in layout.module_names}

    def _view(self, region: Region) -> torch.Tensor:
        return _frombuffer(self.segment.buf, torch.float32, region.numel, region.offset).view(region.rows, region.cols)

    def current(self) -> bool:
        """Whether the name still refers to the segment we mapped."""
        return segment_identity(self.layout.segment_name) in (self.identity, None)

    def close(self) -> None:
        self.x, self.out = [], {}
        self.segment.close()


class StoreViews:
    """Flat typed views of the host adapter store (read-only), one per dtype."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.segment = SharedSegment.attach(name, readonly=True)
        self.identity = bytes(self.segment.buf[:HEADER_BYTES])
        self.size = self.segment.size
        self._flat: dict[str, torch.Tensor] = {}

    def current(self) -> bool:
        return segment_identity(self.name) in (self.identity, None)

    def block(self, offset: int, rows: int, cols: int, dtype: str) -> torch.Tensor:
        """[rows, cols] of `dtype` at byte `offset` of the segment (a view, no copy)."""
        flat = self._flat.get(dtype)
        if flat is None:
            tdtype = store_dtype(dtype)
            flat = _frombuffer(self.segment.buf, tdtype, self.size // tdtype.itemsize, 0)
            self._flat[dtype] = flat
        itemsize = flat.element_size()
        if offset % itemsize or offset < 0 or offset + rows * cols * itemsize > self.size:
            raise ShmError(errno.EINVAL, f"store block at byte {offset} ({rows}x{cols} {dtype}) is misaligned "
                                         f"or outside {self.name} ({self.size} bytes)")
        return flat.narrow(0, offset // itemsize, rows * cols).view(rows, cols)

    def close(self) -> None:
        self._flat = {}
        self.segment.close()
