"""ipc.shm: segment names per instance, create/attach/readonly/close/unlink, space
reserved up front (clean ShmError instead of SIGBUS), attachers never unlink,
and the sweep removes dead owners' segments while keeping live ones."""
from __future__ import annotations

import dataclasses
import errno
import multiprocessing
import os
import sys
import time

import pytest

from loraplex import _C
from loraplex.ipc import shm
from loraplex.ipc.shm import (
    HEADER_BYTES,
    SegmentHeader,
    SharedSegment,
    ShmError,
    instance_segment_name,
    list_segments,
    owner_alive,
    segment_name,
    sweep_stale,
    unlink_segment,
)
from tests.shm_testing import SHM_DIR, shm_names  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


def exists(name: str) -> bool:
    return (SHM_DIR / name[1:]).exists()


def test_names_derive_from_the_instance(tmp_path) -> None:
    a = instance_segment_name(tmp_path / "a", "exchange-0")
    b = instance_segment_name(tmp_path / "b", "exchange-0")
    assert a != b and a.startswith("/lpx-") and a.endswith("-exchange-0")
    assert instance_segment_name(tmp_path / "a", "exchange-0") == a  # stable across restarts
    assert segment_name("abc123", "store") == "/lpx-abc123-store"
    for bad in ("", "a/b", "-x", "x" * 65, "a b"):
        with pytest.raises(ValueError):
            segment_name(bad, "store")
        with pytest.raises(ValueError):
            segment_name("abc", bad)
    for bad_name in ("noslash", "/a/b", "/", "/" + "x" * 300):
        with pytest.raises(ValueError):
            SharedSegment.create(bad_name, 4096)


def test_create_attach_readonly_close_unlink(shm_names) -> None:
    name = shm_names()
    seg = SharedSegment.create(name, 10_000)
    assert seg.owner and seg.size == 10_000 and seg.name == name and len(seg.buf) == 10_000
    assert oct(os.stat(SHM_DIR / name[1:]).st_mode & 0o777) == oct(0o600)
    header = seg.header
    assert header.owner_pid == os.getpid() and header.size == 10_000
    assert abs(header.created_ns - time.time_ns()) < 60e9
    assert bytes(seg.buf[HEADER_BYTES:]) == bytes(10_000 - HEADER_BYTES)
    with pytest.raises(FileExistsError):
        SharedSegment.create(name, 4096)

    seg.buf[100:105] = b"hello"
    _C.atomic_store(seg.buf, 16, 42)
    peer = SharedSegment.attach(name)
    assert not peer.owner and peer.size == 10_000
    assert bytes(peer.buf[100:105]) == b"hello" and _C.atomic_load(peer.buf, 16) == 42
    peer.buf[200] = 7
    assert seg.buf[200] == 7
    with pytest.raises(ShmError, match="only the creating process"):
        peer.unlink()

    ro = SharedSegment.attach(name, readonly=True)
    assert ro.readonly and ro.buf.readonly and bytes(ro.buf[100:105]) == b"hello"
    with pytest.raises(TypeError):
        ro.buf[0] = 1
    with pytest.raises(BufferError):
        _C.atomic_load(ro.buf, 16)

    for s in (peer, ro):
        s.close()
        s.close()  # idempotent
        assert s.closed
        with pytest.raises(ValueError, match="closed"):
            _ = s.buf
    assert exists(name), "closing an attachment removed the segment"

    seg.unlink()
    seg.unlink()  # idempotent
    assert not exists(name)
    assert bytes(seg.buf[100:105]) == b"hello", "the owner's mapping outlives the name"
    with pytest.raises(ShmError) as info:
        SharedSegment.attach(name)
    assert info.value.errno == errno.ENOENT
    seg.close()


def test_context_manager_unlinks_for_the_owner_only(shm_names) -> None:
    name = shm_names()
    with SharedSegment.create(name, 4096) as seg:
        with SharedSegment.attach(name) as peer:
            assert peer.buf is not None
        assert exists(name)
        assert seg.buf is not None
    assert not exists(name)


def test_close_never_unmaps_under_a_live_view(shm_names) -> None:
    with SharedSegment.create(shm_names(), 4096) as seg:
        seg.buf[64:67] = b"abc"
        view = seg.buf[64:128]  # a consumer's view (numpy/torch views hold the buffer the same way)
        seg.close()
        assert seg.closed
        assert bytes(view[:3]) == b"abc"
        view[3] = 1  # still mapped, still writable
        view.release()


def test_attach_refuses_foreign_and_missing_segments(shm_names) -> None:
    name = shm_names("foreign")
    fd = os.open(SHM_DIR / name[1:], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"not a loraplex header".ljust(4096, b"\0"))
    finally:
        os.close(fd)
    try:
        with pytest.raises(ShmError, match="not a loraplex segment"):
            SharedSegment.attach(name)
    finally:
        assert unlink_segment(name)
    assert not unlink_segment(name)
    with pytest.raises(ShmError):
        SharedSegment.attach(shm_names("missing"))


def test_too_large_for_dev_shm_is_a_clean_error(shm_names) -> None:
    free = shm.shm_free_bytes()
    assert free is not None
    need = free + (1 << 30)
    name = shm_names()
    with pytest.raises(ShmError) as info:
        SharedSegment.create(name, need)
    assert info.value.errno == errno.ENOSPC
    assert f"need {need} bytes" in str(info.value) and "/dev/shm has" in str(info.value)
    assert not exists(name), "the refused segment was left behind"


def test_reservation_failure_is_a_clean_error(shm_names, monkeypatch) -> None:
    """fallocate is what turns a full tmpfs into an error instead of SIGBUS on first touch."""
    calls = []

    def full(fd, offset, length):
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = shm_names()
    with pytest.raises(ShmError) as info:
        SharedSegment.create(name, 1 << 20)
    assert calls == [1 << 20]
    assert info.value.errno == errno.ENOSPC and "need 1048576 bytes" in str(info.value)
    assert not exists(name)


def test_creation_reserves_the_pages(shm_names) -> None:
    size = 8 << 20
    with SharedSegment.create(shm_names(), size) as seg:
        allocated = os.stat(SHM_DIR / seg.name[1:]).st_blocks * 512
        assert allocated >= size, "pages were not reserved at creation"


def _attach_write_and_exit(name: str, clean: bool) -> None:
    seg = SharedSegment.attach(name)
    seg.buf[HEADER_BYTES] = 99
    if clean:
        seg.close()
        return
    os._exit(0)  # no cleanup at all, like a crash


def test_child_attach_and_exit_does_not_unlink(shm_names) -> None:
    ctx = multiprocessing.get_context("spawn")
    with SharedSegment.create(shm_names(), 4096) as seg:
        for clean in (True, False):
            child = ctx.Process(target=_attach_write_and_exit, args=(seg.name, clean))
            child.start()
            child.join(60)
            assert child.exitcode == 0
            assert exists(seg.name), f"a child exiting ({'clean' if clean else 'crash'}) unlinked the segment"
            assert seg.buf[HEADER_BYTES] == 99
            seg.buf[HEADER_BYTES] = 0
        peer = SharedSegment.attach(seg.name)  # still attachable by others
        peer.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_is_not_the_owner(shm_names) -> None:
    with SharedSegment.create(shm_names(), 4096) as seg:
        pid = os.fork()
        if pid == 0:  # child: must not be able to unlink the parent's segment
            code = 0
            try:
                seg.unlink()
                code = 1
            except ShmError:
                code = 0 if not seg.owner else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert exists(seg.name)


def _create_and_die(name: str) -> None:
    seg = SharedSegment.create(name, 4096)
    seg.buf[HEADER_BYTES] = 1
    os._exit(0)  # dies owning the segment, never unlinks


def test_sweep_removes_dead_owners_and_keeps_live_ones(shm_names) -> None:
    ctx = multiprocessing.get_context("spawn")
    dead = shm_names("dead")
    child = ctx.Process(target=_create_and_die, args=(dead,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and exists(dead)
    header = SegmentHeader.unpack((SHM_DIR / dead[1:]).read_bytes()[:HEADER_BYTES])
    assert header is not None and header.owner_pid == child.pid
    assert not owner_alive(header.owner_pid, header.owner_start)

    with SharedSegment.create(shm_names("live"), 4096) as live:
        # Another test's or daemon's live segments under the general prefix are never touched.
        assert sweep_stale(shm_names.prefix) == [dead]
        assert not exists(dead) and exists(live.name)
        assert live.name in list_segments(shm_names.prefix)
        assert sweep_stale(shm_names.prefix) == []
        assert exists(live.name)


@pytest.mark.skipif(shm.process_start_ticks(os.getpid()) is None, reason="needs /proc")
def test_sweep_detects_a_reused_pid(shm_names) -> None:
    """A header whose pid now belongs to a process started at another time is stale."""
    name = shm_names("reused")
    seg = SharedSegment.create(name, 4096)
    header = seg.header
    forged = SegmentHeader(owner_pid=header.owner_pid, owner_start=header.owner_start + 1,
                           created_ns=header.created_ns, size=header.size)
    seg.buf[:HEADER_BYTES] = forged.pack()
    seg.close()
    assert owner_alive(os.getpid(), header.owner_start)
    assert not owner_alive(os.getpid(), header.owner_start + 1)
    assert sweep_stale(shm_names.prefix) == [name]


@pytest.mark.skipif(not shm.pid_namespace(), reason="needs /proc/self/ns/pid")
def test_sweep_never_judges_an_owner_in_another_pid_namespace(shm_names) -> None:
    """A pid from another namespace (a container sharing /dev/shm) says nothing about liveness here."""
    name = shm_names("container")
    seg = SharedSegment.create(name, 4096)
    header = seg.header
    assert header.owner_pidns == shm.pid_namespace()
    foreign = dataclasses.replace(header, owner_pid=2**31 - 2, owner_start=1, owner_pidns=header.owner_pidns + 1)
    seg.buf[:HEADER_BYTES] = foreign.pack()
    assert sweep_stale(shm_names.prefix) == []
    dead_here = dataclasses.replace(foreign, owner_pidns=header.owner_pidns)
    seg.buf[:HEADER_BYTES] = dead_here.pack()
    seg.close()
    assert sweep_stale(shm_names.prefix) == [name]


def test_sweep_keeps_young_headerless_segments_and_removes_old_ones(shm_names) -> None:
    name = shm_names("headerless")
    path = SHM_DIR / name[1:]
    path.write_bytes(b"")  # as if its creator were between shm_open and writing the header
    assert sweep_stale(shm_names.prefix) == []
    old = time.time() - shm.HEADERLESS_GRACE_S - 10
    os.utime(path, (old, old))
    assert sweep_stale(shm_names.prefix) == [name]


def test_owner_alive_basics() -> None:
    assert owner_alive(os.getpid(), shm.process_start_ticks(os.getpid()) or 0)
    assert not owner_alive(0) and not owner_alive(-5)
    if sys.platform.startswith("linux"):
        assert owner_alive(1)  # init: exists (another user's process counts as alive)


def test_segment_header_round_trip() -> None:
    header = SegmentHeader(owner_pid=123, owner_start=456, created_ns=789, size=4096, owner_pidns=42)
    packed = header.pack()
    assert len(packed) == HEADER_BYTES
    assert SegmentHeader.unpack(packed) == header
    assert SegmentHeader.unpack(b"\0" * HEADER_BYTES) is None
    assert SegmentHeader.unpack(packed[:10]) is None


def test_invalid_sizes_are_refused(shm_names) -> None:
    for size in (0, HEADER_BYTES - 1, -1, 1.5, True):
        with pytest.raises(ValueError):
            SharedSegment.create(shm_names(), size)
