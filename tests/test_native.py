"""loraplex._C: the stub matches the module, and the atomics are atomic, bounds-
checked and refuse buffers they cannot treat as aligned, writable 64-bit words."""
from __future__ import annotations

import array
import ast
import ctypes
import importlib
import inspect
import mmap
import multiprocessing
import random
import re
import threading
import time
from pathlib import Path

import pytest

import loraplex
from loraplex import _C

STUB = Path(loraplex.__file__).with_name("_C.pyi")
MASK = (1 << 64) - 1


def stub_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(STUB.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def runtime_params(func) -> list[str]:
    """Parameter names from the pybind11 signature line of the docstring."""
    first = func.__doc__.splitlines()[0]
    m = re.fullmatch(rf"{func.__name__}\((.*)\) -> (\w+)", first)
    assert m, first
    return [part.split(":")[0].strip() for part in m.group(1).split(", ")]


def test_stub_lists_exactly_the_public_functions() -> None:
    public = {name for name, obj in inspect.getmembers(_C) if not name.startswith("_") and callable(obj)}
    non_callables = {name for name in dir(_C) if not name.startswith("_")} - public
    stub = stub_functions()
    assert set(stub) == public
    assert non_callables == set(), "the module exports a non-function the stub does not declare"
    for name, node in stub.items():
        assert [a.arg for a in node.args.args] == runtime_params(getattr(_C, name)), name
        assert ast.unparse(node.returns) == "int"


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
