"""Property-based frames on the client and admin sockets of a live daemon while one
client streams: random bytes, msgpack of random shapes, and envelopes of every
message type (engine-internal ones too) with random field values. Every reply is
a well-formed message, the stream's largest gap between tokens stays under half a
second, nothing is registered, and the daemon answers normally afterwards.

Lifecycle orders (drain, pause, set_policy) are never sent: a well-formed one would
be obeyed, which is the admin socket doing its job, not a robustness failure.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.ipc.client import AdminClient, Client
from loraplex.ipc.codec import decode
from loraplex.ipc.protocol import PROTOCOL_VERSION
from tests.daemon_process import DaemonProcess

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
try:
    from flood_gap import GapStream, frozen_heap, warm_up
finally:
    sys.path.remove(str(BENCH))

MAX_GAP_S = 0.5
OBEYED = {"drain", "pause", "set_policy"}  # well-formed, these change the daemon's state by design
TYPES = ["generate", "cancel", "adapters", "stats", "ping", "add_adapter", "remove_adapter", "pin_adapter",
         "admin_ok", "cache_hello", "cache_store_full", "cpu_worker_hello", "cpu_lora_job", "cpu_job_done",
         "engine_hello", "engine_step", "engine_step_done", "engine_shutdown", "engine_failure", "token", "done",
         "error", "adapter_list", "stats_snapshot", "pong", "", "GENERATE", "generate\x00", "x" * 200]
FIELDS = ["request_id", "prompt", "prompt_token_ids", "adapter", "max_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "priority", "slo_ttft_ms", "deadline_ms",
          "name", "path", "replace", "pinned", "v", "type", "stream"]
assert not OBEYED & set(TYPES)

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40) | st.binary(max_size=40)
           | st.sampled_from(["/etc/shadow", "../../etc", "/", "qv-r8", ".", "..", "a" * 300, "\x00"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)
envelopes = st.fixed_dictionaries(
    {"v": st.sampled_from([PROTOCOL_VERSION]) | values, "type": st.sampled_from(TYPES) | st.text(max_size=12)},
    optional={k: values for k in FIELDS[:-3]},
).filter(lambda body: body.get("type") not in OBEYED)
frames = (st.binary(max_size=512)
          | envelopes.map(lambda body: msgpack.packb(body, use_bin_type=True))
          | values.map(lambda v: msgpack.packb(v, use_bin_type=True))
          | st.lists(st.binary(max_size=64), min_size=2, max_size=3))  # multipart


def _send(sock: zmq.Socket, frame) -> None:
    if isinstance(frame, list):
        sock.send_multipart(frame)
    else:
        sock.send(frame)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    proc = DaemonProcess(tmp_path_factory.mktemp("fuzz")).start()
    warm_up(proc.runtime_dir)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_fuzzed_frames_never_break_replies_stall_a_stream_or_register_anything(daemon) -> None:
    ctx = zmq.Context.instance()
    endpoints = {False: f"ipc://{daemon.runtime_dir}/client.sock", True: f"ipc://{daemon.runtime_dir}/admin.sock"}
    replies: list[str] = []
    with Client(runtime_dir=daemon.runtime_dir) as client:
        before = sorted(a.name for a in client.adapters())
        stream = GapStream(client, max_tokens=4000)
        stream.start()
        assert stream.first.wait(60), "the stream never started"

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
        @given(batch=st.lists(frames, min_size=1, max_size=4), admin=st.booleans())
        def fuzz(batch, admin: bool) -> None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoints[admin])  # a new peer each time: its requests end with it
            try:
                for frame in batch:
                    _send(sock, frame)
                deadline = time.monotonic() + 0.05
                while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    reply = decode(sock.recv())  # raises on anything but a well-formed message
                    replies.append(reply.TYPE)
            finally:
                sock.close()

        with frozen_heap():  # the gaps are the daemon's, not this process's garbage collector's
            since = time.monotonic()
            fuzz()
            time.sleep(0.3)  # a stall right at the end shows as the last gap
            until = time.monotonic()
        stream.stop.set()
        stream.join(30)
        assert stream.error is None, stream.error
        gaps = stream.gaps_ms(since, until)
        assert max(gaps) < MAX_GAP_S * 1e3, f"largest gap {max(gaps):.0f} ms"
        assert "error" in replies, "no frame was even refused: the fuzzing never reached the daemon"
        assert client.ping(timeout=5.0) < 5.0
        assert sorted(a.name for a in client.adapters()) == before
        after = client.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True, timeout=30)
        assert len(after.token_ids) == 4
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin_client:
        admin_client.ping(timeout=5.0)
