"""ipc.exchange: the activation exchange layout (no overlaps, alignment, one cache
line per sequence word), its travel as a message record, its segment header,
and the per-site protocol run end to end between this process and two workers."""
from __future__ import annotations

import dataclasses
import multiprocessing
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex import _C
from loraplex.ipc.errors import ProtocolError
from loraplex.ipc.exchange import (
    CACHE_LINE,
    MODULE_STAGE,
    MODULES,
    STAGE_MODULES,
    STAGES,
    ExchangeLayout,
    exchange_layout,
)
from loraplex.ipc.messages.fields import compile_checker
from loraplex.ipc.shm import HEADER_BYTES, ShmError
from tests.shm_testing import shm_names  # noqa: F401  (fixture)

dims = st.integers(min_value=1, max_value=700)


def small_layout(name: str = "/lpx-test-layout", **over: int) -> ExchangeLayout:
    fields = dict(num_layers=2, hidden=8, q_dim=8, kv_dim=4, intermediate=12, max_tokens=4)
    fields.update(over)
    return exchange_layout(name, **fields)


def test_stage_constants() -> None:
    assert STAGES == ("attn_in", "o_in", "mlp_in", "down_in")
    assert STAGE_MODULES == (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    assert MODULES == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert MODULE_STAGE["o_proj"] == 1 and MODULE_STAGE["down_proj"] == 3


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 40), hidden=dims, q_dim=dims, kv_dim=dims, intermediate=dims,
       max_tokens=st.integers(1, 300))
def test_layout_has_no_overlaps_and_everything_aligned(layers, hidden, q_dim, kv_dim, intermediate,
                                                       max_tokens) -> None:
    layout = exchange_layout("/lpx-test-x", layers, hidden, q_dim, kv_dim, intermediate, max_tokens)
    # Words: ready/done per site plus control, distinct, each alone on its cache line, after both headers.
    words = [layout.control_word]
    for site in range(layout.num_sites):
        words += [layout.ready_word(site), layout.done_word(site)]
    lines = {w * 8 // CACHE_LINE for w in words}
    assert len(lines) == len(words) == 2 * layers * 4 + 1
    assert min(words) * 8 >= HEADER_BYTES + CACHE_LINE  # segment header, then exchange header
    assert max(words) * 8 + 8 <= layout.words_end
    # Regions: aligned, inside the segment, disjoint from each other and from the words.
    extents = [(0, layout.words_end)]
    regions = layout.regions()
    assert list(regions) == list(STAGES) + list(MODULES)
    for region in regions.values():
        assert region.offset % 64 == 0 and region.dtype == "float32" and region.rows == max_tokens
        assert region.end <= layout.total_bytes
        extents.append((region.offset, region.end))
    extents.sort()
    for (_, end), (start, _) in zip(extents, extents[1:]):
        assert end <= start
    assert layout.total_bytes % 4096 == 0
    # Shapes: a stage's x is as wide as the in_features of each of its modules.
    for stage, modules in enumerate(STAGE_MODULES):
        x = layout.x_region(stage)
        assert x == layout.x_region(STAGES[stage])
        for module in modules:
            fan_in, fan_out = layout.module_shape(module)
            assert x.cols == fan_in and layout.out_region(module).cols == fan_out
    assert layout.module_shape("o_proj") == (q_dim, hidden)
    assert layout.module_shape("down_proj") == (intermediate, hidden)
    assert layout.module_shape("k_proj") == (hidden, kv_dim)


def test_sites_and_bounds() -> None:
    layout = small_layout()
    assert layout.num_sites == 8
    assert [layout.site(1, s) for s in range(4)] == [4, 5, 6, 7]
    for bad in ((2, 0), (0, 4), (-1, 0)):
        with pytest.raises(IndexError):
            layout.site(*bad)
    for bad_site in (-1, 8):
        with pytest.raises(IndexError):
            layout.ready_word(bad_site)
        with pytest.raises(IndexError):
            layout.done_word(bad_site)
    with pytest.raises(KeyError):
        layout.out_region("lm_head")
    with pytest.raises(IndexError):
        layout.x_region(4)
    with pytest.raises(ValueError):
        layout.x_region("nope")
    for field in ("num_layers", "hidden", "q_dim", "kv_dim", "intermediate", "max_tokens"):
        for bad_value in (0, -3, True, 2.0):
            with pytest.raises(ValueError):
                small_layout(**{field: bad_value})
    with pytest.raises(ValueError):
        small_layout(name="no-slash")


def test_layout_travels_as_a_message_record() -> None:
    layout = small_layout()
    check = compile_checker(ExchangeLayout)
    wire = msgpack.unpackb(msgpack.packb(dataclasses.asdict(layout)))
    assert wire == {"segment_name": "/lpx-test-layout", "num_layers": 2, "hidden": 8, "q_dim": 8, "kv_dim": 4,
                    "intermediate": 12, "max_tokens": 4}
    decoded = check(wire, "exchange")
    assert decoded == layout and decoded.out_region("up_proj") == layout.out_region("up_proj")
    with pytest.raises(ProtocolError):
        check({**wire, "hidden": 0}, "exchange")
    with pytest.raises(ProtocolError):
        check({**wire, "extra": 1}, "exchange")


def test_ipc_layout_modules_never_import_torch_or_numpy() -> None:
    code = ("import sys, loraplex.ipc.shm, loraplex.ipc.exchange, loraplex.ipc.adapter_store; "
            "bad = {'torch', 'numpy'} & set(sys.modules); sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_segment_header_checks_dimensions(shm_names) -> None:
    layout = small_layout(shm_names("exchange"))
    seg = layout.create_segment()
    try:
        assert seg.size == layout.total_bytes
        assert all(_C.atomic_load(seg.buf, layout.ready_word(s)) == 0 for s in range(layout.num_sites))
        peer = layout.attach_segment()
        peer.close()
        other = dataclasses.replace(layout, hidden=16)
        with pytest.raises(ShmError):
            other.attach_segment()
        with pytest.raises(ShmError):
            dataclasses.replace(layout, max_tokens=3).check_header(seg.buf)
    finally:
        seg.close()
        seg.unlink()


# -- the protocol, end to end ------------------------------------------------------------


def _x_value(seq: int, site: int, row: int, col: int) -> int:
    return seq * 10_000 + site * 100 + row * 10 + col  # exact in float32


def _out_value(x: float, module: str) -> float:
    return 2 * x + MODULES.index(module)


def _worker(fields: dict, me: int, workers: int, steps: int) -> None:
    layout = ExchangeLayout(**fields)
    seg = layout.attach_segment()
    buf = seg.buf
    floats = buf.cast("f")
    try:
        for seq in range(1, steps + 1):
            for site in range(layout.num_sites):
                if not _C.wait_until_at_least(buf, layout.ready_word(site), seq, 20_000):
                    raise SystemExit(f"worker {me}: no ready for step {seq} site {site}")
                x = layout.x_region(site % 4)
                for module in STAGE_MODULES[site % 4]:
                    out = layout.out_region(module)
                    for row in range(me, layout.max_tokens, workers):  # this worker's rows
                        for col in range(out.cols):
                            xv = floats[x.row_offset(row) // 4 + col % x.cols]
                            floats[out.row_offset(row) // 4 + col] = _out_value(xv, module)
                _C.add_and_wake(buf, layout.done_word(site), 1)
    finally:
        floats.release()
        del buf
        seg.close()


def test_protocol_end_to_end_with_two_worker_processes(shm_names) -> None:
    workers, steps = 2, 3
    layout = small_layout(shm_names("exchange"))
    seg = layout.create_segment()
    buf = seg.buf
    floats = buf.cast("f")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(dataclasses.asdict(layout), k, workers, steps))
             for k in range(workers)]
    try:
        for p in procs:
            p.start()
        for seq in range(1, steps + 1):
            for site in range(layout.num_sites):
                x = layout.x_region(site % 4)
                for row in range(layout.max_tokens):
                    for col in range(x.cols):
                        floats[x.row_offset(row) // 4 + col] = _x_value(seq, site, row, col)
                _C.store_and_wake(buf, layout.ready_word(site), seq)
                assert _C.wait_until_at_least(buf, layout.done_word(site), seq * workers, 60_000), (seq, site)
                for module in STAGE_MODULES[site % 4]:
                    out = layout.out_region(module)
                    for row in range(layout.max_tokens):
                        got = floats[out.row_offset(row) // 4:out.row_offset(row + 1) // 4].tolist()
                        want = [_out_value(_x_value(seq, site, row, col % x.cols), module) for col in range(out.cols)]
                        assert got == want, (seq, site, module, row)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        floats.release()
        del buf
        seg.close()
        seg.unlink()
