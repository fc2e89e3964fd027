"""loraplex._C: the stub matches the module; the atomics are atomic (threads and
processes), bounds-checked and refuse buffers they cannot treat as aligned,
writable 64-bit words; futex waits block across processes, wake, time out,
release the GIL and honour signals."""
from __future__ import annotations

import array
import ast
import ctypes
import importlib
import inspect
import math
import mmap
import multiprocessing
import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest

import loraplex
from loraplex import _C
from loraplex.ipc.shm import SharedSegment
from tests.shm_testing import shm_names  # noqa: F401  (fixture)

STUB = Path(loraplex.__file__).with_name("_C.pyi")
MASK = (1 << 64) - 1


def stub_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(STUB.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def runtime_signature(func) -> tuple[list[str], list[str], str]:
    """(parameter names, names of those with defaults, return type) from the
    pybind11 signature line of the docstring."""
    first = func.__doc__.splitlines()[0]
    m = re.fullmatch(rf"{func.__name__}\((.*)\) -> (.+)", first)
    assert m, first
    parts = [part for part in m.group(1).split(", ") if part]
    names = [part.split(":")[0].strip() for part in parts]
    defaults = [name for name, part in zip(names, parts) if "=" in part]
    return names, defaults, m.group(2)


def test_stub_lists_exactly_the_public_functions() -> None:
    public = {name for name, obj in inspect.getmembers(_C) if not name.startswith("_") and callable(obj)}
    non_callables = {name for name in dir(_C) if not name.startswith("_")} - public
    stub = stub_functions()
    assert set(stub) == public
    assert non_callables == set(), "the module exports a non-function the stub does not declare"
    for name, node in stub.items():
        names, defaults, returns = runtime_signature(getattr(_C, name))
        assert [a.arg for a in node.args.args] == names, name
        with_defaults = [a.arg for a in node.args.args[len(node.args.args) - len(node.args.defaults):]]
        assert with_defaults == defaults, name
        assert ast.unparse(node.returns) == returns, name


def test_stub_defaults_match_the_module() -> None:
    node = stub_functions()["wait_until_at_least"]
    assert ast.literal_eval(node.args.defaults[0]) == 50.0
    assert "spin_us: typing.SupportsFloat | typing.SupportsIndex = 50.0" in _C.wait_until_at_least.__doc__


def test_stub_imports_resolve_on_this_python() -> None:
    # A type checker for a supported Python must find every name the stub imports.
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module}.{alias.name} does not exist here"


def aligned_start(raw: bytearray) -> int:
    """Offset of the first 8-byte aligned byte of `raw`."""
    return -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % 8


def aligned_view(nbytes: int) -> tuple[bytearray, memoryview]:
    """A writable, 8-byte aligned view of `nbytes` zero bytes."""
    raw = bytearray(nbytes + 8)
    start = aligned_start(raw)
    return raw, memoryview(raw)[start:start + nbytes]


def test_fetch_add_returns_previous_values_and_load_sees_the_sum() -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    words = rng.randint(1, 16)
    _, buf = aligned_view(8 * words)
    model = [0] * words
    for _ in range(500):
        i = rng.randrange(words)
        v = rng.choice([rng.randrange(1 << 8), rng.randrange(1 << 64)])
        assert _C.atomic_fetch_add(buf, i, v) == model[i], f"seed {seed}"
        model[i] = (model[i] + v) & MASK
        assert _C.atomic_load(buf, i) == model[i], f"seed {seed}"
    assert [int.from_bytes(buf[8 * i:8 * i + 8], "little") for i in range(words)] == model


def test_fetch_add_wraps_modulo_two_to_the_64() -> None:
    _, buf = aligned_view(8)
    _C.atomic_fetch_add(buf, 0, MASK)
    assert _C.atomic_fetch_add(buf, 0, 3) == MASK
    assert _C.atomic_load(buf, 0) == 2
    for bad in (-1, 1 << 64):
        with pytest.raises(TypeError):
            _C.atomic_fetch_add(buf, 0, bad)


def test_other_buffer_types_and_shapes_count_in_words() -> None:
    words = array.array("Q", [0] * 4)
    assert _C.atomic_fetch_add(words, 3, 5) == 0 and words[3] == 5
    raw, buf = aligned_view(64)
    grid = buf.cast("B", shape=[4, 16])  # C-contiguous 2-D: 8 words
    assert _C.atomic_fetch_add(grid, 7, 1) == 0 and _C.atomic_load(buf, 7) == 1
    with pytest.raises(IndexError):
        _C.atomic_load(grid, 8)


def test_concurrent_increments_from_threads() -> None:
    _, buf = aligned_view(16)
    threads, per_thread = 4, 10_000
    seen: list[list[int]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def work(k: int) -> None:
        start.wait()
        out = seen[k]
        for _ in range(per_thread):
            out.append(_C.atomic_fetch_add(buf, 1, 1))

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert _C.atomic_load(buf, 1) == threads * per_thread
    assert _C.atomic_load(buf, 0) == 0
    # Every increment saw a distinct previous value: none was lost or duplicated.
    assert sorted(v for out in seen for v in out) == list(range(threads * per_thread))


def _child_increments(path: str, n: int, out_path: str) -> None:
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as shared:
        _C.atomic_fetch_add(shared, 0, 1)  # ready
        while _C.atomic_load(shared, 1) == 0:  # wait for the parent to start as well
            pass
        prev = array.array("Q", (_C.atomic_fetch_add(shared, 2, 1) for _ in range(n)))
    Path(out_path).write_bytes(prev.tobytes())


def test_concurrent_increments_across_processes_on_shared_mmap(tmp_path: Path) -> None:
    n = 10_000
    path = tmp_path / "words"
    path.write_bytes(bytes(64))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as shared:
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_child_increments, args=(str(path), n, str(tmp_path / "child")))
        child.start()
        try:
            deadline = time.monotonic() + 60
            while _C.atomic_load(shared, 0) == 0:
                assert child.is_alive() and time.monotonic() < deadline, "child never got ready"
                time.sleep(0.001)
            _C.atomic_fetch_add(shared, 1, 1)  # go
            mine = [_C.atomic_fetch_add(shared, 2, 1) for _ in range(n)]
            child.join(60)
        finally:
            if child.is_alive():
                child.kill()
                child.join()
        assert child.exitcode == 0
        assert _C.atomic_load(shared, 2) == 2 * n
    theirs = array.array("Q", (tmp_path / "child").read_bytes()).tolist()
    assert sorted(mine + theirs) == list(range(2 * n))


def test_index_out_of_range_raises_index_error() -> None:
    _, buf = aligned_view(32)
    for index in (4, 5, -1, -4, 1 << 61, (1 << 61) + 1, (1 << 63) - 1):
        with pytest.raises(IndexError):
            _C.atomic_fetch_add(buf, index, 1)
        with pytest.raises(IndexError):
            _C.atomic_load(buf, index)
    _, partial = aligned_view(12)  # one whole word and a half
    assert _C.atomic_load(partial, 0) == 0
    with pytest.raises(IndexError):
        _C.atomic_load(partial, 1)
    with pytest.raises(IndexError):
        _C.atomic_load(bytearray(), 0)
    assert bytes(buf) == bytes(32), "a refused call wrote anyway"


def test_misaligned_buffers_raise() -> None:
    raw = bytearray(40)
    start = aligned_start(raw)
    for shift in range(1, 8):
        view = memoryview(raw)[start + shift:start + shift + 16]
        with pytest.raises(ValueError, match="aligned"):
            _C.atomic_fetch_add(view, 0, 1)
        with pytest.raises(ValueError, match="aligned"):
            _C.atomic_load(view, 0)
    assert bytes(raw) == bytes(len(raw))


def test_strided_views_raise() -> None:
    raw, buf = aligned_view(64)
    words = buf.cast("Q")
    for view in (buf[::2], buf[::-1], words[::2], words[::-1]):
        with pytest.raises(ValueError, match="contiguous"):
            _C.atomic_fetch_add(view, 0, 1)
    assert bytes(raw) == bytes(len(raw)), "a strided view was written through"


def test_readonly_buffers_raise(tmp_path: Path) -> None:
    _, buf = aligned_view(16)
    path = tmp_path / "ro"
    path.write_bytes(bytes(16))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as ro_map:
        for readonly in (bytes(16), buf.toreadonly(), ro_map):
            with pytest.raises(BufferError):
                _C.atomic_fetch_add(readonly, 0, 1)
            with pytest.raises(BufferError):
                _C.atomic_load(readonly, 0)
    for not_a_buffer in (None, 3, "text"):
        with pytest.raises(TypeError):
            _C.atomic_load(not_a_buffer, 0)


# -- every word function refuses what it cannot use ------------------------------------

# Extra arguments after (buf, index) that make each call return at once on a zero word.
WORD_FUNCTIONS = {
    "atomic_load": (),
    "atomic_store": (1,),
    "atomic_fetch_add": (1,),
    "atomic_compare_exchange": (0, 1),
    "futex_wait": (1, 0),  # low half 0 differs from 1: returns True without sleeping
    "futex_wake": (),
    "wait_until_at_least": (0, 0),
    "store_and_wake": (1,),
    "add_and_wake": (1,),
}


CUDA_FUNCTIONS = {"cuda_stream_ops_unavailable", "cuda_launch_store_and_wake", "cuda_word_device_pointer",
                  "cuda_stream_wait_at_least"}


def test_word_function_table_covers_the_module() -> None:
    assert set(WORD_FUNCTIONS) == set(stub_functions()) - {"has_futex"} - CUDA_FUNCTIONS


def test_cuda_stream_ops_say_why_they_are_unavailable_without_a_driver() -> None:
    if not os.path.exists("/dev/nvidiactl"):
        # No NVIDIA driver here: every entry point refuses cleanly instead of crashing.
        assert "libcuda" in _C.cuda_stream_ops_unavailable()
        raw, buf = aligned_view(32)
        with pytest.raises(RuntimeError, match="libcuda"):
            _C.cuda_stream_wait_at_least(0, 0, 1)
        with pytest.raises(RuntimeError, match="libcuda"):
            _C.cuda_launch_store_and_wake(0, buf, 0, 1)
        assert bytes(raw) == bytes(len(raw))


@pytest.mark.parametrize("name", sorted(WORD_FUNCTIONS))
def test_every_word_function_checks_its_buffer(name: str) -> None:
    func, extra = getattr(_C, name), WORD_FUNCTIONS[name]
    raw, buf = aligned_view(32)
    func(buf, 3, *extra)  # the last word is fine
    raw[:] = bytes(len(raw))
    for index in (4, -1, 1 << 61):
        with pytest.raises(IndexError):
            func(buf, index, *extra)
    start = aligned_start(raw)
    with pytest.raises(ValueError, match="aligned"):
        func(memoryview(raw)[start + 4:start + 20], 0, *extra)
    with pytest.raises(ValueError, match="contiguous"):
        func(buf.cast("Q")[::2], 0, *extra)
    with pytest.raises(BufferError):
        func(buf.toreadonly(), 0, *extra)
    with pytest.raises(TypeError):
        func(None, 0, *extra)
    assert bytes(raw) == bytes(len(raw)), "a refused call wrote anyway"


# -- store and compare-exchange ------------------------------------------------------------


def test_store_and_compare_exchange_semantics() -> None:
    _, buf = aligned_view(16)
    _C.atomic_store(buf, 1, MASK)
    assert _C.atomic_load(buf, 1) == MASK and _C.atomic_load(buf, 0) == 0
    assert _C.atomic_compare_exchange(buf, 1, 5, 7) == (False, MASK)  # mismatch: observed value, no write
    assert _C.atomic_load(buf, 1) == MASK
    assert _C.atomic_compare_exchange(buf, 1, MASK, 3) == (True, MASK)
    assert _C.atomic_load(buf, 1) == 3
    assert _C.atomic_compare_exchange(buf, 0, 0, 0) == (True, 0)
    for bad in (-1, 1 << 64):
        with pytest.raises(TypeError):
            _C.atomic_store(buf, 0, bad)
        with pytest.raises(TypeError):
            _C.atomic_compare_exchange(buf, 0, 0, bad)
    assert _C.add_and_wake(buf, 1, MASK) == 3 and _C.atomic_load(buf, 1) == 2  # wraps like fetch_add
    _C.store_and_wake(buf, 1, 9)
    assert _C.atomic_load(buf, 1) == 9


def _cas_increment(buf, index: int) -> int:
    """Increment through a compare-exchange loop; returns the number of failed attempts."""
    failures = 0
    current = _C.atomic_load(buf, index)
    while True:
        swapped, observed = _C.atomic_compare_exchange(buf, index, current, current + 1)
        if swapped:
            return failures
        failures += 1
        current = observed


def test_compare_exchange_loops_from_threads_lose_no_increment() -> None:
    _, buf = aligned_view(8)
    threads, per_thread = 4, 5_000
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            _cas_increment(buf, 0)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert _C.atomic_load(buf, 0) == threads * per_thread


# -- atomics across processes on a shared segment ---------------------------------------

STARTED, GO, FINISHED, ADDS, CASES = 8, 16, 24, 32, 40  # word indices, one cache line each


def _child_hammer(name: str, n: int) -> None:
    seg = SharedSegment.attach(name)
    buf = seg.buf
    _C.add_and_wake(buf, STARTED, 1)
    if not _C.wait_until_at_least(buf, GO, 1, 30_000):
        raise SystemExit(3)
    for _ in range(n):
        _C.atomic_fetch_add(buf, ADDS, 1)
        _cas_increment(buf, CASES)
    _C.add_and_wake(buf, FINISHED, 1)
    del buf
    seg.close()


@pytest.mark.parametrize("children", [1, 3])
def test_atomics_from_several_processes_on_a_shared_segment(shm_names, children: int) -> None:
    n = 4_000
    ctx = multiprocessing.get_context("spawn")
    with SharedSegment.create(shm_names(), 4096) as seg:
        buf = seg.buf
        procs = [ctx.Process(target=_child_hammer, args=(seg.name, n)) for _ in range(children)]
        try:
            for p in procs:
                p.start()
            assert _C.wait_until_at_least(buf, STARTED, children, 60_000), "children never attached"
            _C.store_and_wake(buf, GO, 1)
            for _ in range(n):
                _C.atomic_fetch_add(buf, ADDS, 1)
                _cas_increment(buf, CASES)
            assert _C.wait_until_at_least(buf, FINISHED, children, 60_000)
            for p in procs:
                p.join(30)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        assert _C.atomic_load(buf, ADDS) == (children + 1) * n
        assert _C.atomic_load(buf, CASES) == (children + 1) * n
        del buf


# -- futex wait and wake ------------------------------------------------------------------

needs_futex = pytest.mark.skipif(not _C.has_futex(), reason="no futex on this OS (polling fallback)")
WAITING, SIGNAL, RESULT = 8, 16, 24


def _child_futex_waiter(name: str) -> None:
    seg = SharedSegment.attach(name)
    buf = seg.buf
    _C.store_and_wake(buf, WAITING, 1)
    woken = _C.futex_wait(buf, SIGNAL, 0, 30_000)
    _C.store_and_wake(buf, RESULT, 1 if woken else 2)
    del buf
    seg.close()


def test_futex_wait_in_a_child_blocks_until_woken(shm_names) -> None:
    ctx = multiprocessing.get_context("spawn")
    with SharedSegment.create(shm_names(), 4096) as seg:
        buf = seg.buf
        child = ctx.Process(target=_child_futex_waiter, args=(seg.name,))
        child.start()
        try:
            assert _C.wait_until_at_least(buf, WAITING, 1, 60_000), "child never started waiting"
            time.sleep(0.3)
            assert child.is_alive() and _C.atomic_load(buf, RESULT) == 0, "futex_wait returned without a change"
            woken_at = time.monotonic()
            _C.store_and_wake(buf, SIGNAL, 1)
            assert _C.wait_until_at_least(buf, RESULT, 1, 10_000)
            assert time.monotonic() - woken_at < 2.0
            child.join(30)
            assert child.exitcode == 0
            assert _C.atomic_load(buf, RESULT) == 1, "the child saw a timeout instead of the wake"
        finally:
            if child.is_alive():
                child.kill()
                child.join()
        del buf


def _child_adds(name: str, count: int) -> None:
    seg = SharedSegment.attach(name)
    buf = seg.buf
    for _ in range(count):
        time.sleep(0.001)
        _C.add_and_wake(buf, SIGNAL, 1)
    del buf
    seg.close()


@pytest.mark.parametrize("spin_us", [0, 50])
def test_wait_until_at_least_across_processes(shm_names, spin_us: float) -> None:
    ctx = multiprocessing.get_context("spawn")
    with SharedSegment.create(shm_names(), 4096) as seg:
        buf = seg.buf
        child = ctx.Process(target=_child_adds, args=(seg.name, 20))
        child.start()
        try:
            for target in (1, 10, 20):
                assert _C.wait_until_at_least(buf, SIGNAL, target, 60_000, spin_us)
                assert _C.atomic_load(buf, SIGNAL) >= target
            child.join(30)
            assert child.exitcode == 0
        finally:
            if child.is_alive():
                child.kill()
                child.join()
        del buf


def test_timeouts_return_false_after_about_the_timeout() -> None:
    _, buf = aligned_view(8)
    for wait in (lambda ms: _C.futex_wait(buf, 0, 0, ms),
                 lambda ms: _C.wait_until_at_least(buf, 0, 1, ms),
                 lambda ms: _C.wait_until_at_least(buf, 0, 1, ms, spin_us=0)):
        t0 = time.monotonic()
        assert wait(100) is False
        assert 0.095 <= time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        assert wait(0) is False
        assert time.monotonic() - t0 < 0.05
    for bad in (math.nan,):
        with pytest.raises(ValueError):
            _C.futex_wait(buf, 0, 0, bad)
        with pytest.raises(ValueError):
            _C.wait_until_at_least(buf, 0, 1, bad)
    for bad_spin in (-1.0, math.nan):
        with pytest.raises(ValueError):
            _C.wait_until_at_least(buf, 0, 1, 10, spin_us=bad_spin)


def test_satisfied_waits_return_true_at_once_even_without_timeout() -> None:
    _, buf = aligned_view(8)
    _C.atomic_store(buf, 0, 1 << 63)
    assert _C.futex_wait(buf, 0, 1, -1) is True
    assert _C.wait_until_at_least(buf, 0, (1 << 63) - 1, -1) is True  # unsigned comparison
    assert _C.wait_until_at_least(buf, 0, 1 << 63, -1) is True
    assert _C.wait_until_at_least(buf, 0, MASK, 0) is False


def test_futex_wait_compares_the_low_32_bits_only() -> None:
    _, buf = aligned_view(8)
    _C.atomic_store(buf, 0, (5 << 32) | 7)
    assert _C.futex_wait(buf, 0, 7, 20) is False  # low half equal: waits (and times out)
    assert _C.futex_wait(buf, 0, (9 << 32) | 7, 20) is False  # `expected` is masked to its low half
    assert _C.futex_wait(buf, 0, 5 << 32, 20) is True  # low half 7 != 0
    # wait_until_at_least compares all 64 bits even though it sleeps on the low half.
    assert _C.wait_until_at_least(buf, 0, (5 << 32) | 8, 20) is False
    assert _C.wait_until_at_least(buf, 0, 4 << 32, 0) is True


@needs_futex
def test_futex_wake_reports_woken_waiters_and_a_bare_wake_does_not_end_the_wait() -> None:
    _, buf = aligned_view(8)
    assert _C.futex_wake(buf, 0) == 0
    results: list[bool] = []
    lock = threading.Lock()

    def waiter() -> None:
        woken = _C.futex_wait(buf, 0, 0, 20_000)
        with lock:
            results.append(woken)

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        best, deadline = 0, time.monotonic() + 10
        while best < 3 and time.monotonic() < deadline:
            best = max(best, _C.futex_wake(buf, 0))  # value unchanged: the waiters sleep again
            time.sleep(0.005)
        assert best == 3
        assert results == [], "a wake without a change ended futex_wait"
    finally:
        _C.store_and_wake(buf, 0, 1)
        for t in threads:
            t.join(30)
    assert results == [True, True, True]


def test_waits_release_the_gil() -> None:
    _, buf = aligned_view(16)
    waits = {
        "futex_wait": lambda: _C.futex_wait(buf, 0, 0, 5_000),
        "wait_until_at_least": lambda: _C.wait_until_at_least(buf, 1, 1, 5_000),
    }
    for index, (name, wait) in enumerate(waits.items()):
        results: list[bool] = []
        t = threading.Thread(target=lambda: results.append(wait()))
        t0 = time.monotonic()
        t.start()
        # Python work on this thread while the other one waits: impossible if the wait held the GIL.
        spins, until = 0, time.monotonic() + 0.2
        while time.monotonic() < until:
            spins += 1
        _C.store_and_wake(buf, index, 1)
        t.join(30)
        assert results == [True], name
        assert time.monotonic() - t0 < 3.0, f"{name} kept the GIL until its timeout"
        assert spins > 1000, name


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_waits_on_the_main_thread_run_signal_handlers() -> None:
    # Python runs signal handlers on the main thread only; pytest runs tests there.
    assert threading.current_thread() is threading.main_thread()

    class Alarm(Exception):
        pass

    def on_alarm(signum, frame):
        raise Alarm

    _, buf = aligned_view(8)
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for wait in (lambda: _C.futex_wait(buf, 0, 0, -1), lambda: _C.wait_until_at_least(buf, 0, 1, -1)):
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            t0 = time.monotonic()
            with pytest.raises(Alarm):
                wait()
            assert time.monotonic() - t0 < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
