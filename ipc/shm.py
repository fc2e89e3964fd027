"""Named POSIX shared-memory segments of one daemon instance.

Owns segment names (`/lpx-<instance>-<purpose>`), creation with the space
reserved up front, attaching, the 64-byte owner header every segment starts
with, and the sweep of segments whose owner died. Never imports torch or numpy
(consumers make their own views of `.buf`) and never uses
multiprocessing.shared_memory, whose resource tracker unlinks live segments
when any process that attached them exits.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing uses, minus the tracker)
    import _posixshmem
except ImportError:  # pragma: no cover - every CPython on Linux and macOS has it
    _posixshmem = None

from loraplex.ipc.runtime_dir import instance_id

SEGMENT_PREFIX = "/lpx-"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (a tmpfs)
HEADER_BYTES = 64  # the owner header; layouts place their content after it
MAGIC = b"LPXSEG\x00\x01"
HEADER_VERSION = 1
# A segment without a complete header is being created right now, or was left
# by a creator that died within microseconds of shm_open: sweep it only when older.
HEADERLESS_GRACE_S = 60.0

# magic, version, header bytes, owner pid, owner start time (clock ticks since
# boot, 0 if unknown), creation time (ns since the epoch), total size, owner's pid
# namespace (inode of /proc/self/ns/pid, 0 if unknown); 8 bytes spare.
_HEADER = struct.Struct("<8sIIqQqQQ8x")  # 64 bytes
_NAME = re.compile(r"/[A-Za-z0-9][A-Za-z0-9._-]{0,240}")
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


# Names this process created and has not unlinked yet: what it removes when its parent dies
# (unlink_owned, called by loraplex.lifetime's watcher), so a SIGKILLed daemon leaves nothing behind.
_OWNED: dict[str, int] = {}  # name -> creating pid (a forked child inherits the map, not the ownership)


class ShmError(OSError):
    """A segment cannot be created, attached or used (no space, missing, not ours, not owner)."""


# Element sizes of the dtypes a Region may hold (names as torch and numpy spell them).
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Region:
    """A row-major [rows, cols] array of `dtype` at byte `offset` of a segment."""

    offset: int
    rows: int
    cols: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        if self.offset < 0 or self.rows < 0 or self.cols < 0:
            raise ValueError(f"region offset, rows and cols must be >= 0, got {self}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def row_bytes(self) -> int:
        return self.cols * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def end(self) -> int:
        """First byte after the region."""
        return self.offset + self.nbytes

    def row_offset(self, row: int) -> int:
        """Byte offset of row `row` (0 <= row <= rows; rows gives `end`)."""
        if not 0 <= row <= self.rows:
            raise IndexError(f"row {row} outside [0, {self.rows}]")
        return self.offset + row * self.row_bytes


def segment_name(instance: str, purpose: str) -> str:
    """`/lpx-<instance>-<purpose>`; ValueError unless both are short identifiers."""
    for label, part in (("instance", instance), ("purpose", purpose)):
        if not _PART.fullmatch(part):
            raise ValueError(f"segment {label} must match {_PART.pattern}, got {part!r}")
    return f"{SEGMENT_PREFIX}{instance}-{purpose}"


def instance_segment_name(runtime_dir: str | os.PathLike[str], purpose: str) -> str:
    """The segment name for `purpose` of the daemon owning `runtime_dir`, so that
    two daemons on one host never collide and a restarted one finds its own."""
    return segment_name(instance_id(runtime_dir), purpose)


def check_segment_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"shared-memory name must match {_NAME.pattern} (one leading '/'), got {name!r}")


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is not None:
        return _posixshmem.shm_open(name, flags, mode)
    return os.open(os.path.join(SHM_DIR, name[1:]), flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink(name)
    else:
        os.unlink(os.path.join(SHM_DIR, name[1:]))


def shm_free_bytes() -> int | None:
    """Bytes an unprivileged process may still allocate in /dev/shm; None where unknown."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc), None if unknown or gone.

    With the pid it identifies a process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def _process_state(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2:]
    return rest[:1] or None


def pid_namespace() -> int:
    """Inode of this process's pid namespace (Linux), 0 where unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def owner_alive(pid: int, start_ticks: int = 0, pidns: int = 0) -> bool:
    """Whether the process that wrote a header (`pid`, started at `start_ticks`, in
    pid namespace `pidns`) still runs.

    A pid that no longer exists, a zombie, or a pid now used by a process that
    started at another time are dead owners. Another user's live process counts as
    alive, and so does any owner in another pid namespace (a container sharing
    /dev/shm): its pid means nothing here. Without /proc only the pid is checked."""
    here = pid_namespace()
    if pidns and here and pidns != here:
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if _process_state(pid) in (b"Z", b"X"):
        return False
    if start_ticks:
        now = process_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False
    return True


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """The first HEADER_BYTES of every loraplex segment."""

    owner_pid: int
    owner_start: int
    created_ns: int
    size: int
    owner_pidns: int = 0
    version: int = HEADER_VERSION

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.version, HEADER_BYTES, self.owner_pid, self.owner_start, self.created_ns,
                            self.size, self.owner_pidns)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> SegmentHeader | None:
        """The header in `data`, or None if it is not a complete loraplex header."""
        if len(data) < HEADER_BYTES:
            return None
        magic, version, header_bytes, pid, start, created, size, pidns = _HEADER.unpack_from(data)
        if magic != MAGIC or header_bytes != HEADER_BYTES:
            return None
        return cls(owner_pid=pid, owner_start=start, created_ns=created, size=size, owner_pidns=pidns,
                   version=version)


class SharedSegment:
    """One mapped POSIX shared-memory segment.

    `buf` is a memoryview of the whole mapping (header included: offsets in
    layouts count from the segment start). The creating process is the owner
    and the only one that may `unlink`; attaching and closing never unlink,
    so a worker that exits (or crashes) leaves the segment to its owner.
    """

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool, readonly: bool) -> None:
        self._name = name
        self._mmap: mmap.mmap | None = mm
        self._buf: memoryview | None = memoryview(mm)
        self._size = size
        self._owner_pid = os.getpid() if owner else 0
        self._readonly = readonly
        self._unlinked = False

    @classmethod
    def create(cls, name: str, size: int) -> SharedSegment:
        """Create `name` exclusively with `size` bytes (header included), reserve the
        space now, map it read-write and write the owner header.

        Raises FileExistsError if the name is taken, ShmError (ENOSPC) if /dev/shm
        cannot hold it: the space is reserved up front, so a full tmpfs fails here
        rather than with SIGBUS on first touch of a page.
        """
        check_segment_name(name)
        if isinstance(size, bool) or not isinstance(size, int) or size < HEADER_BYTES:
            raise ValueError(f"segment size must be an int >= {HEADER_BYTES}, got {size!r}")
        fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        try:
            header = SegmentHeader(owner_pid=os.getpid(), owner_start=process_start_ticks(os.getpid()) or 0,
                                   created_ns=time.time_ns(), size=size, owner_pidns=pid_namespace())
            # The header goes in through the fd first: a sweeper that finds the name
            # sees a live owner at once, and a full tmpfs answers ENOSPC, not SIGBUS.
            try:
                os.pwrite(fd, header.pack(), 0)
            except OSError as exc:
                raise _space_error(exc, size) from None
            free = shm_free_bytes()
            if free is not None and size - HEADER_BYTES > free:
                raise ShmError(errno.ENOSPC, f"cannot create {name}: need {size} bytes, {SHM_DIR} has {free} free")
            os.ftruncate(fd, size)
            _reserve(fd, size, name)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                _shm_unlink(name)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)  # the mapping keeps the memory; mmap holds its own descriptor
        _OWNED[name] = os.getpid()
        return cls(name, mm, size, owner=True, readonly=False)

    @classmethod
    def attach(cls, name: str, readonly: bool = False) -> SharedSegment:
        """Map an existing loraplex segment. ShmError if it does not exist or has no
        valid header; a readonly mapping gives a read-only `buf` (the _C word
        functions need a writable one)."""
        check_segment_name(name)
        try:
            fd = _shm_open(name, os.O_RDONLY if readonly else os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(errno.ENOENT, f"shared-memory segment {name} does not exist") from None
        try:
            actual = os.fstat(fd).st_size
            header = SegmentHeader.unpack(os.pread(fd, HEADER_BYTES, 0)) if actual >= HEADER_BYTES else None
            if header is None:
                raise ShmError(errno.EINVAL, f"{name} is not a loraplex segment (no valid header)")
            if header.size > actual:
                raise ShmError(errno.EINVAL, f"{name} header says {header.size} bytes, segment has {actual}")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, header.size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        return cls(name, mm, header.size, owner=False, readonly=readonly)

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def owner(self) -> bool:
        """True in the process that created the segment (not in forked children)."""
        return self._owner_pid == os.getpid()

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def closed(self) -> bool:
        return self._buf is None

    @property
    def buf(self) -> memoryview:
        """The whole mapping as bytes; ValueError once closed."""
        if self._buf is None:
            raise ValueError(f"segment {self._name} is closed")
        return self._buf

    @property
    def header(self) -> SegmentHeader:
        header = SegmentHeader.unpack(self.buf[:HEADER_BYTES])
        if header is None:
            raise ShmError(errno.EINVAL, f"{self._name}: header was overwritten")
        return header

    def close(self) -> None:
        """Unmap (idempotent). If consumers still hold views of `buf` (numpy,
        torch.frombuffer, memoryview slices) the mapping stays valid until the
        last of them is gone; it is never unmapped under a live view."""
        buf, mm = self._buf, self._mmap
        self._buf = self._mmap = None
        if buf is None or mm is None:
            return
        try:
            buf.release()
            mm.close()
        except BufferError:
            pass  # exported views keep the mapping alive; it unmaps when they are collected

    def unlink(self) -> None:
        """Remove the name (owner only; idempotent). Processes that mapped the
        segment keep their mapping; the memory is freed when the last one unmaps."""
        if not self.owner:
            raise ShmError(errno.EPERM, f"only the creating process unlinks {self._name}")
        if self._unlinked:
            return
        self._unlinked = True
        _OWNED.pop(self._name, None)
        try:
            _shm_unlink(self._name)
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close; the owner also unlinks."""
        self.close()
        if self.owner:
            self.unlink()

    def __reduce__(self) -> Any:
        raise TypeError("SharedSegment cannot be pickled: send its name and attach in the other process")

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("ro" if self._readonly else "rw")
        return f"SharedSegment({self._name!r}, size={self._size}, owner={self.owner}, {state})"


def _space_error(exc: OSError, size: int) -> OSError:
    if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        free = shm_free_bytes()
        shown = "unknown" if free is None else str(free)
        return ShmError(errno.ENOSPC, f"need {size} bytes, {SHM_DIR} has {shown} free ({exc.strerror})")
    return exc


def _reserve(fd: int, size: int, name: str) -> None:
    """Allocate every page now (tmpfs supports fallocate) so later writes cannot SIGBUS."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # macOS: no reservation available; the size check above is all we have
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem without fallocate: nothing to reserve with
        err = _space_error(exc, size)
        if isinstance(err, ShmError):
            raise ShmError(errno.ENOSPC, f"cannot create {name}: {err.strerror}") from None
        raise


def unlink_segment(name: str) -> bool:
    """Remove `name` regardless of owner (the supervisor cleaning up after a dead
    child); False if it did not exist."""
    check_segment_name(name)
    try:
        _shm_unlink(name)
    except FileNotFoundError:
        return False
    return True


def unlink_owned() -> list[str]:
    """Unlink every segment this process created and still owns (its parent died: nobody will
    sweep them before the next start); returns their names. Safe from any thread."""
    removed = []
    me = os.getpid()
    for name, pid in list(_OWNED.items()):
        if pid == me and _OWNED.pop(name, None) is not None and unlink_segment(name):
            removed.append(name)
    return removed


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of this user's segments starting with `prefix` (Linux: from /dev/shm)."""
    if not prefix.startswith("/"):
        raise ValueError(f"prefix must start with '/', got {prefix!r}")
    try:
        entries = os.scandir(SHM_DIR)
    except OSError:
        return []
    uid = os.getuid()
    names = []
    with entries:
        for entry in entries:
            name = "/" + entry.name
            if not name.startswith(prefix) or not _NAME.fullmatch(name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid == uid and entry.is_file(follow_symlinks=False):
                names.append(name)
    return sorted(names)


def _is_stale(name: str, now: float) -> bool:
    path = os.path.join(SHM_DIR, name[1:])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, or not ours to read
    try:
        info = os.fstat(fd)
        header = SegmentHeader.unpack(os.pread(fd, HEADER_BYTES, 0))
    finally:
        os.close(fd)
    if header is None:
        return now - info.st_mtime > HEADERLESS_GRACE_S
    return not owner_alive(header.owner_pid, header.owner_start, header.owner_pidns)


def sweep_stale(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink this user's segments under `prefix` whose owner process is gone;
    return their names. A live owner's segments are never touched (a segment
    whose header is still being written is kept for HEADERLESS_GRACE_S)."""
    removed = []
    now = time.time()
    for name in list_segments(prefix):
        if _is_stale(name, now) and unlink_segment(name):
            removed.append(name)
    return removed
