"""Opening adapter files (ipc/adapter_files.py, the PEFT loader and the daemon's
hashing reader on top of it): a FIFO is refused without blocking, a symlink out
of the allowed directories is refused and its target's bytes never appear in an
error, int64 tensors and a header that claims a huge length are refused, a slow
read fails at its deadline without holding up others, and a valid adapter still
loads (also through a symlink that stays inside); a pickled adapter_model.bin
passes the same checks (allow-list, regular file) and loads the same weights."""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from loraplex.daemon.adapter_hash import AdapterReader, adapter_content_hash
from loraplex.errors import AdapterError, ForbiddenAdapterPathError
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.ipc.adapter_files import (
    ADAPTER_WEIGHTS,
    AdapterFileError,
    open_adapter_file,
    read_safetensors_header,
    resolve_roots,
)
from tests import adversarial_adapters as adv

DEADLINE_S = 10.0  # a call that blocks on a FIFO never returns; this bounds the test instead


def _within(fn, *args, **kwargs):
    """fn(*args) on a daemon thread; its result or exception, or a failure if it blocks."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised below, on the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"{fn.__name__} blocked for {DEADLINE_S} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


@pytest.fixture(scope="module")
def model(demo) -> ModelConfig:
    return ModelConfig.from_dir(demo.model_dir)


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    root.mkdir()
    return root


def _load(path: Path, model: ModelConfig, roots: tuple[str, ...] = ()):
    return load_peft_adapter("x", path, model, max_lora_rank=64, dtype=torch.float32, roots=roots)


def test_a_fifo_weights_file_is_refused_without_blocking(demo, model, allowed):
    bad = adv.fifo_weights(demo.adapters["qv-r8"], allowed / "fifo")
    with pytest.raises(AdapterError, match="not a regular file"):
        _within(_load, bad, model)
    with pytest.raises(AdapterFileError, match="not a regular file"):
        _within(read_safetensors_header, bad)


def test_a_fifo_swapped_in_after_the_check_does_not_block_the_open(tmp_path):
    """O_NONBLOCK on the open itself: even a FIFO that passes no stat check cannot hang us."""
    fifo = tmp_path / ADAPTER_WEIGHTS
    os.mkfifo(fifo)
    fd = _within(os.open, fifo, os.O_RDONLY | os.O_NONBLOCK)  # what open_adapter_file does after its check
    os.close(fd)


def test_a_symlink_out_of_the_allowed_directory_is_refused_and_never_echoed(demo, model, allowed, tmp_path):
    bad = adv.symlink_out(demo.adapters["qv-r8"], allowed / "escape", tmp_path / "etc")
    roots = resolve_roots([allowed])
    with pytest.raises(ForbiddenAdapterPathError) as err:
        _within(_load, bad, model, roots)
    assert err.value.code == "forbidden_path" and "outside the allowed adapter directories" in str(err.value)
    assert adv.SECRET[:12] not in str(err.value)
    with pytest.raises(AdapterFileError) as raw:
        with open_adapter_file(bad, ADAPTER_WEIGHTS, roots):
            pass
    assert raw.value.code == "forbidden_path"
    # Without an allow-list the same file opens (anywhere is allowed), but it is no safetensors file,
    # and the error says so without quoting it.
    with pytest.raises(AdapterError) as loose:
        _within(_load, bad, model)
    assert adv.SECRET[:12] not in str(loose.value) and "not a valid safetensors file" in str(loose.value)


def test_a_symlink_that_stays_inside_loads(demo, model, allowed):
    real = adv.valid(demo.adapters["qv-r8"], allowed / "store" / "qv")
    linked = allowed / "linked"
    linked.mkdir()
    for name in os.listdir(real):
        os.symlink(real / name, linked / name)
    adapter = _load(linked, model, resolve_roots([allowed]))
    assert adapter.spec.rank == 8 and adapter.nbytes > 0


def test_int64_tensors_are_refused(demo, model, allowed):
    bad = adv.int64_weights(demo.adapters["qv-r8"], allowed / "int64")
    with pytest.raises(AdapterError, match="must be floating point") as err:
        _load(bad, model)
    assert "I64" in str(err.value)


def test_a_huge_header_length_is_refused_before_reading_it(demo, model, allowed):
    bad = adv.huge_header(demo.adapters["qv-r8"], allowed / "huge")
    with pytest.raises(AdapterError, match="header length is out of bounds"):
        _load(bad, model)


def test_a_tensor_extent_outside_the_file_is_refused(demo, allowed):
    good = adv.valid(demo.adapters["qv-r8"], allowed / "cut")
    data = (good / ADAPTER_WEIGHTS).read_bytes()
    (good / ADAPTER_WEIGHTS).write_bytes(data[:-64])  # truncated: the last tensor runs past the end
    with pytest.raises(AdapterFileError, match="lies outside the file"):
        read_safetensors_header(good)


def test_a_valid_adapter_loads_the_same_weights(demo, model, allowed):
    adapter = _load(adv.valid(demo.adapters["all-r32"], allowed / "all"), model, resolve_roots([allowed]))
    reference = _load(demo.adapters["all-r32"], model)
    assert adapter.spec == reference.spec
    assert all(torch.equal(adapter.a[i][m], reference.a[i][m]) and torch.equal(adapter.b[i][m], reference.b[i][m])
               for i in range(model.num_layers) for m in adapter.spec.targets)


def test_the_daemon_hash_refuses_a_fifo_without_blocking(demo, allowed):
    """The daemon's own read (the content hash): the old open() waited for a writer forever."""
    bad = adv.fifo_weights(demo.adapters["qv-r8"], allowed / "fifo")
    with pytest.raises(AdapterFileError, match="not a regular file"):
        _within(adapter_content_hash, bad)


def test_the_reader_bounds_a_slow_read_and_keeps_serving_others(demo, allowed):
    """A read stuck in the filesystem (here: waiting on an event) fails at the deadline; reads of other
    adapters meanwhile complete, and the loop never waits on either."""
    good = adv.valid(demo.adapters["qv-r8"], allowed / "good")
    stuck = threading.Event()

    async def scenario() -> None:
        reader = AdapterReader(resolve_roots([allowed]), timeout_s=0.5)
        slow = asyncio.create_task(reader.run(lambda p: stuck.wait(30), str(good)))
        fingerprint, digest = await reader.identify(str(good))  # served while the slow read hangs
        assert digest == adapter_content_hash(good) and fingerprint
        with pytest.raises(AdapterFileError, match="could not be read within 0.5 s"):
            await slow

    try:
        asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    finally:
        stuck.set()


def test_the_demo_adapters_join_an_allow_list_but_never_narrow_anywhere(tmp_path):
    from loraplex.ipc.adapter_files import allow_also

    roots = resolve_roots([tmp_path / "mine"])
    assert allow_also(roots, [tmp_path / "demo"]) == (*roots, str(tmp_path / "demo"))
    assert allow_also(allow_also(roots, [tmp_path / "demo"]), [tmp_path / "demo"]) == (*roots, str(tmp_path / "demo"))
    assert allow_also((), [tmp_path / "demo"]) == ()  # no allow-list: anywhere, still


def test_a_bin_adapter_loads_the_same_weights_and_the_daemon_hashes_it(demo, model, allowed):
    as_bin = adv.as_bin(demo.adapters["all-r32"], allowed / "bin")
    adapter = _load(as_bin, model, resolve_roots([allowed]))
    reference = _load(demo.adapters["all-r32"], model)
    assert adapter.spec == reference.spec
    assert all(torch.equal(adapter.a[i][m], reference.a[i][m]) and torch.equal(adapter.b[i][m], reference.b[i][m])
               for i in range(model.num_layers) for m in adapter.spec.targets)
    digest = adapter_content_hash(as_bin, resolve_roots([allowed]))
    assert digest and digest != adapter_content_hash(demo.adapters["all-r32"])


def test_a_bin_symlinked_out_or_a_fifo_is_refused_like_safetensors(demo, model, allowed, tmp_path):
    bad = adv.symlink_out(demo.adapters["qv-r8"], allowed / "escape", tmp_path / "etc", weights=adv.BIN)
    roots = resolve_roots([allowed])
    with pytest.raises(ForbiddenAdapterPathError) as err:
        _within(_load, bad, model, roots)
    assert "outside the allowed adapter directories" in str(err.value) and adv.SECRET[:12] not in str(err.value)
    with pytest.raises(AdapterFileError) as raw:
        adapter_content_hash(bad, roots)
    assert raw.value.code == "forbidden_path"
    with pytest.raises(AdapterError) as loose:  # anywhere allowed: opened, but no pickle torch accepts
        _within(_load, bad, model)
    assert adv.SECRET[:12] not in str(loose.value) and "restricted" in str(loose.value)
    fifo = adv.fifo_weights(demo.adapters["qv-r8"], allowed / "fifo", weights=adv.BIN)
    with pytest.raises(AdapterError, match="not a regular file"):
        _within(_load, fifo, model)
    with pytest.raises(AdapterFileError, match="not a regular file"):
        _within(adapter_content_hash, fifo)
