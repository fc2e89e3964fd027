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
    STAGES,
    ExchangeLayout,
    ExchangeModule,
    exchange_layout,
    llama_module_shapes,
)
from loraplex.ipc.messages.fields import compile_checker
from loraplex.ipc.shm import HEADER_BYTES, ShmError
from tests.shm_testing import shm_names  # noqa: F401  (fixture)

dims = st.integers(min_value=1, max_value=700)


def small_layout(name: str = "/lpx-test-layout", **over: int) -> ExchangeLayout:
    dims = dict(hidden=8, q_dim=8, kv_dim=4, intermediate=12)
    fields = dict(num_layers=2, max_tokens=4)
    for key, value in over.items():
        (dims if key in dims else fields)[key] = value
    return exchange_layout(name, fields["num_layers"], llama_module_shapes(**dims), fields["max_tokens"])


def fused_shapes(hidden: int, q_dim: int, kv_dim: int, intermediate: int, *, gate: bool = True) -> dict:
    """Phi-3's module_shapes() (gate=True: gate_up_proj) or GPT-2's (an MLP without gate)."""
    shapes = {"qkv_proj": (hidden, q_dim + 2 * kv_dim), "o_proj": (q_dim, hidden)}
    shapes.update({"gate_up_proj": (hidden, 2 * intermediate)} if gate else {"up_proj": (hidden, intermediate)})
    return {**shapes, "down_proj": (intermediate, hidden)}


def test_stage_constants() -> None:
    assert STAGES == ("attn_in", "o_in", "mlp_in", "down_in")
    layout = small_layout()
    assert [layout.stage_modules(s) for s in range(4)] == [("q_proj", "k_proj", "v_proj"), ("o_proj",),
                                                           ("gate_proj", "up_proj"), ("down_proj",)]
    assert MODULE_STAGE["o_proj"] == 1 and MODULE_STAGE["down_proj"] == 3
    assert MODULE_STAGE["qkv_proj"] == 0 and MODULE_STAGE["gate_up_proj"] == 2


def test_models_with_fused_projections_get_their_own_slots() -> None:
    """Phi-3's qkv_proj and gate_up_proj, GPT-2's MLP without gate: a slot per module of the model, as wide
    as its module_shapes() says; a name or width the model lacks is refused."""
    phi3 = exchange_layout("/lpx-test-phi3", 3, fused_shapes(16, 16, 8, 24), 5)
    assert [phi3.stage_modules(s) for s in range(4)] == [("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",)]
    assert phi3.out_region("qkv_proj").cols == 32 and phi3.out_region("gate_up_proj").cols == 48
    assert [phi3.in_features(s) for s in range(4)] == [16, 16, 16, 24]
    assert list(phi3.regions()) == list(STAGES) + ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    with pytest.raises(KeyError, match="qkv_proj"):
        phi3.out_region("q_proj")
    gpt2 = exchange_layout("/lpx-test-gpt2", 2, fused_shapes(16, 16, 16, 64, gate=False), 5)
    assert gpt2.stage_modules(2) == ("up_proj",) and gpt2.module_shape("up_proj") == (16, 64)
    assert phi3._header_bytes() != dataclasses.replace(phi3, modules=gpt2.modules, num_layers=3)._header_bytes()
    bad = {"unknown": {"lm_head": (16, 512), **fused_shapes(16, 16, 8, 24)},
           "a stage without modules": {"qkv_proj": (16, 32), "o_proj": (16, 16), "down_proj": (24, 16)},
           "one stage, two widths": {**llama_module_shapes(16, 16, 8, 24), "k_proj": (12, 8)},
           "out of stage order": dict(reversed(list(fused_shapes(16, 16, 8, 24).items())))}
    for why, shapes in bad.items():
        with pytest.raises(ValueError):
            exchange_layout("/lpx-test-bad", 2, shapes, 5)
            pytest.fail(why)
    with pytest.raises(ValueError):
        ExchangeModule("qkv_proj", 16, 0)


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 40), hidden=dims, q_dim=dims, kv_dim=dims, intermediate=dims,
       max_tokens=st.integers(1, 300))
def test_layout_has_no_overlaps_and_everything_aligned(layers, hidden, q_dim, kv_dim, intermediate,
                                                       max_tokens) -> None:
    layout = exchange_layout("/lpx-test-x", layers, llama_module_shapes(hidden, q_dim, kv_dim, intermediate),
                             max_tokens)
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
    assert list(regions) == list(STAGES) + list(layout.module_names)
    for region in regions.values():
        assert region.offset % 64 == 0 and region.dtype == "float32" and region.rows == max_tokens
        assert region.end <= layout.total_bytes
        extents.append((region.offset, region.end))
    extents.sort()
    for (_, end), (start, _) in zip(extents, extents[1:]):
        assert end <= start
    assert layout.total_bytes % 4096 == 0
    # Shapes: a stage's x is as wide as the in_features of each of its modules.
    for stage in range(len(STAGES)):
        modules = layout.stage_modules(stage)
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
    for field in ("num_layers", "hidden", "q_dim", "kv_dim", "intermediate", "max_tokens"):  # modules' widths too
        for bad_value in (0, -3, True, 2.0):
            with pytest.raises(ValueError):
                small_layout(**{field: bad_value})
    with pytest.raises(ValueError):
        small_layout(name="no-slash")


@pytest.mark.parametrize("fused", [False, True])
def test_layout_travels_as_a_message_record(fused) -> None:
    layout = exchange_layout("/lpx-test-layout", 2, fused_shapes(8, 8, 4, 12), 4) if fused else small_layout()
    check = compile_checker(ExchangeLayout)
    wire = msgpack.unpackb(msgpack.packb(dataclasses.asdict(layout)))
    assert wire["segment_name"] == "/lpx-test-layout" and (wire["num_layers"], wire["max_tokens"]) == (2, 4)
    assert wire["modules"][0] == ({"name": "qkv_proj", "in_features": 8, "out_features": 16} if fused
                                  else {"name": "q_proj", "in_features": 8, "out_features": 8})
    decoded = check(wire, "exchange")
    assert decoded == layout and hash(decoded) == hash(layout)
    assert decoded.out_region("down_proj") == layout.out_region("down_proj")
    assert check(layout, "exchange") is layout
    bad_width = [{**m, "out_features": 0} if i == 0 else m for i, m in enumerate(wire["modules"])]
    for bad in ({**wire, "modules": bad_width}, {**wire, "modules": []}, {**wire, "extra": 1},
                {**wire, "modules": [{**wire["modules"][0], "name": "lm_head"}] + wire["modules"][1:]}):
        with pytest.raises(ProtocolError):
            check(bad, "exchange")


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
        other = small_layout(layout.segment_name, kv_dim=2)  # same size, other widths
        assert other.total_bytes == layout.total_bytes
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
    return 2 * x + list(MODULE_STAGE).index(module)


def _worker(layout: ExchangeLayout, me: int, workers: int, steps: int) -> None:
    seg = layout.attach_segment()
    buf = seg.buf
    floats = buf.cast("f")
    try:
        for seq in range(1, steps + 1):
            for site in range(layout.num_sites):
                if not _C.wait_until_at_least(buf, layout.ready_word(site), seq, 20_000):
                    raise SystemExit(f"worker {me}: no ready for step {seq} site {site}")
                x = layout.x_region(site % 4)
                for module in layout.stage_modules(site % 4):
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


@pytest.mark.parametrize("fused", [False, True])
def test_protocol_end_to_end_with_two_worker_processes(shm_names, fused) -> None:
    workers, steps = 2, 3
    layout = (exchange_layout(shm_names("exchange"), 2, fused_shapes(8, 8, 4, 12, gate=False), 4) if fused
              else small_layout(shm_names("exchange")))
    seg = layout.create_segment()
    buf = seg.buf
    floats = buf.cast("f")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(layout, k, workers, steps))
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
                for module in layout.stage_modules(site % 4):
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
