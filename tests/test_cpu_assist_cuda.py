"""The sync-free CUDA signalling of CPU-assisted prefill (runs only on a GPU host)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from loraplex import _C
from tests.shm_testing import shm_names  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu


def test_stream_ordered_store_and_wait_on_host_memory(shm_names):
    from loraplex.gpu_engine.cpu_assist_cuda import cuda_stream_ops_available
    from loraplex.ipc.shm import SharedSegment

    assert cuda_stream_ops_available(), _C.cuda_stream_ops_unavailable()
    seg = SharedSegment.create(shm_names("words"), 4096)
    try:
        words = torch.frombuffer(seg.buf, dtype=torch.uint8)
        assert int(torch.cuda.cudart().cudaHostRegister(words.data_ptr(), seg.size, 0)) == 0
        stream = torch.cuda.Stream()
        gate = torch.cuda.Event()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # keep the stream busy: the store must wait for it
            _C.cuda_launch_store_and_wake(stream.cuda_stream, seg.buf, 8, 7)
            _C.cuda_stream_wait_at_least(stream.cuda_stream, _C.cuda_word_device_pointer(seg.buf, 9), 3)
            gate.record(stream)
        assert _C.atomic_load(seg.buf, 8) == 0, "the store ran before the stream reached it"
        assert _C.wait_until_at_least(seg.buf, 8, 7, 10_000)
        time.sleep(0.05)
        assert not gate.query(), "the stream did not wait for the done word"
        threading.Thread(target=lambda: _C.store_and_wake(seg.buf, 9, 3)).start()
        gate.synchronize()
        torch.cuda.cudart().cudaHostUnregister(words.data_ptr())
        del words
    finally:
        seg.close()
        seg.unlink()
