"""The daemon end to end, as real processes on CPU: what clients receive equals the
offline API, streaming, cancel/disconnect free pages, malformed frames, engine death,
graceful shutdown."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch
import zmq

from loraplex import LLM, SamplingParams
from loraplex.contracts.host import usable_cores
from loraplex.gpu_engine.runtime import auto_cpu_threads
from loraplex.ipc.client import AdminClient, AsyncClient, LoraplexError
from loraplex.ipc.protocol import GenerateRequest
from loraplex.ipc.sockets import make_dealer
from tests.daemon_process import DaemonProcess

ADAPTERS = [None, "qv-r8", "all-r32", "mlp-r64", "rslora-r16", "attn-r16"]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(k),), generator=g).tolist() for k in torch.randint(4, 60, (n,), generator=g)]


@pytest.fixture(scope="module")
def daemon(demo, tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("daemon")).start()
    yield proc
    status = proc.stop()
    assert status == 0, proc.log()
    assert not list(proc.runtime_dir.glob("*.sock")), "socket files left behind"


def _kv_pages(daemon) -> int:
    with daemon.client() as c:
        return c.stats()["pool"]["kv"]


def _wait_idle(daemon, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        with daemon.client() as c:
            stats = c.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["pool"]["kv"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon not idle: {stats}")
        time.sleep(0.1)


def test_concurrent_clients_get_exactly_the_offline_tokens(daemon, demo):
    prompts = _prompts(len(ADAPTERS) * 2)
    adapters = ADAPTERS * 2
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(adapters) - {None}:
        llm.add_adapter(name, demo.adapters[name])
    expected = llm.generate(prompts, adapters=adapters,
                            sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))

    async def run() -> list:
        async with AsyncClient(runtime_dir=daemon.runtime_dir) as client:
            return await asyncio.gather(*[
                client.generate(p, adapter=a, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=60)
                for p, a in zip(prompts, adapters)
            ])

    results = asyncio.run(run())
    for exp, got in zip(expected, results):
        assert got.token_ids == exp.token_ids
        assert got.text == exp.text
        assert got.finish_reason == "length"
        assert got.usage["completion_tokens"] == 12
        for key in ("queue_ms", "ttft_ms", "tpt_ms", "e2e_ms"):
            assert got.timings[key] >= 0.0
        assert got.timings["adapter_path"] in ("base", "cached", "loaded")
    _wait_idle(daemon)


def test_threads_share_one_sync_client(daemon):
    prompts = _prompts(6, seed=3)
    results: dict[int, object] = {}
    with daemon.client() as client:
        def work(i: int) -> None:
            results[i] = client.generate(prompts[i], adapter=ADAPTERS[i % len(ADAPTERS)], max_tokens=5,
                                         temperature=0.0, ignore_eos=True, timeout=60)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert sorted(results) == list(range(6))
    assert all(len(r.token_ids) == 5 for r in results.values())


def test_streaming_in_order_and_concatenates(daemon):
    with daemon.client() as client:
        stream = client.stream("The river that runs", adapter="attn-r16", max_tokens=20, temperature=0.0,
                               ignore_eos=True, timeout=60)
        chunks = list(stream)
        result = stream.result
    assert result is not None and result.finish_reason == "length"
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == result.token_ids
    assert [c.index for c in chunks if c.token_ids] == list(range(20))
    assert "".join(c.text for c in chunks) == result.text
    with daemon.client() as client:
        again = client.generate("The river that runs", adapter="attn-r16", max_tokens=20, temperature=0.0,
                                ignore_eos=True, timeout=60)
    assert again.token_ids == result.token_ids


def test_stop_tokens_and_strings(daemon):
    with daemon.client() as client:
        free = client.generate("Once upon", max_tokens=16, temperature=0.0, ignore_eos=True, timeout=60)
        stop_id = free.token_ids[5]
        first = free.token_ids.index(stop_id)
        stopped = client.generate("Once upon", max_tokens=16, temperature=0.0, ignore_eos=True,
                                  stop_token_ids=[stop_id], timeout=60)
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == free.token_ids[: first + 1]
        needle = free.text[len(free.text) // 2:][:3]
        if needle.strip():
            cut = client.generate("Once upon", max_tokens=16, temperature=0.0, ignore_eos=True, stop=[needle],
                                  timeout=60)
            assert cut.finish_reason == "stop"
            assert needle not in cut.text
            assert free.text.startswith(cut.text)


def test_bad_requests_get_error_codes_and_others_keep_going(daemon):
    with daemon.client() as client:
        cases = [
            (dict(prompt=[1, 2, 3], adapter="nope"), "unknown_adapter"),
            (dict(prompt=list(range(3, 500)) * 10), "prompt_too_long"),
            (dict(prompt=[1, 2, 100000]), "invalid_token"),
        ]
        for kwargs, code in cases:
            prompt = kwargs.pop("prompt")
            with pytest.raises(LoraplexError) as err:
                client.generate(prompt, max_tokens=4, timeout=30, **kwargs)
            assert err.value.code.value == code, err.value
        ok = client.generate([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True, timeout=30)
        assert len(ok.token_ids) == 3


def test_cancel_and_disconnect_return_pages(daemon):
    with daemon.client() as client:
        stream = client.stream(_prompts(1, seed=9)[0], adapter="mlp-r64", max_tokens=4000, ignore_eos=True,
                               temperature=0.0, timeout=120)
        it = iter(stream)
        next(it)
        assert _kv_pages(daemon) > 0
        stream.close()  # leaving a stream early sends a cancel
    _wait_idle(daemon)
    with daemon.client() as client:
        result: list = []
        worker = threading.Thread(target=lambda: result.append(client.generate(
            [7, 7, 7], max_tokens=4000, ignore_eos=True, temperature=0.0, timeout=120, request_id="to-cancel")))
        worker.start()
        deadline = time.monotonic() + 30
        while _kv_pages(daemon) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.cancel("to-cancel")
        worker.join(60)
    assert result and result[0].finish_reason == "cancelled"
    _wait_idle(daemon)
    # A raw client that vanishes mid-stream: the daemon notices on its next send and frees the pages.
    ctx = zmq.Context()
    sock = make_dealer(ctx, f"ipc://{daemon.runtime_dir}/client.sock")
    sock.send(GenerateRequest(request_id="vanish", prompt_token_ids=[5, 6, 7], max_tokens=4000, stream=True,
                              ignore_eos=True))
    sock.recv(timeout_ms=30000)
    sock.close()
    ctx.term()
    stats = _wait_idle(daemon)
    assert stats["cancelled"] >= 2


def test_malformed_frames_do_not_disturb_a_streaming_client(daemon):
    stop = threading.Event()
    replies: list[bytes] = []

    def attacker() -> None:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"ipc://{daemon.runtime_dir}/client.sock")
        payloads = [b"", b"\xc1", b"\x81\xa1v\x01", b"\x92\x01\x02", os.urandom(64), b"\xd4\x01\x00",
                    b"\x82\xa1v\x01\xa4type\xa8generate"]
        i = 0
        while not stop.is_set():
            raw.send(payloads[i % len(payloads)])
            i += 1
            if raw.poll(5):
                replies.append(raw.recv())
        raw.close()
        ctx.term()

    thread = threading.Thread(target=attacker)
    thread.start()
    try:
        with daemon.client() as client:
            stream = client.stream("A good client", max_tokens=24, temperature=0.0, ignore_eos=True, timeout=60)
            chunks = list(stream)
    finally:
        stop.set()
        thread.join(10)
    assert stream.result is not None and len(stream.result.token_ids) == 24
    assert len(chunks) >= 24
    assert replies, "malformed frames got no error reply"


def test_admin_add_and_remove_adapter(daemon, demo):
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.add_adapter("extra", str(demo.adapters["kdown-r8"]))
        names = {a.name for a in admin.adapters()}
        assert "extra" in names
        with pytest.raises(LoraplexError) as err:
            admin.add_adapter("extra", str(demo.adapters["kdown-r8"]))
        assert err.value.code.value == "already_exists"
    with daemon.client() as client:
        via_new = client.generate([9, 8, 7], adapter="extra", max_tokens=4, temperature=0.0, ignore_eos=True,
                                  timeout=30)
        via_old = client.generate([9, 8, 7], adapter="kdown-r8", max_tokens=4, temperature=0.0, ignore_eos=True,
                                  timeout=30)
    assert via_new.token_ids == via_old.token_ids
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.remove_adapter("extra")
        assert "extra" not in {a.name for a in admin.adapters()}


def test_engine_killed_mid_stream_is_recomputed_without_loss_or_duplicates(daemon):
    with daemon.client() as client:
        reference = client.generate([4, 5, 6], max_tokens=40, ignore_eos=True, temperature=0.9, seed=77,
                                    timeout=120)
        engine = client.stats()["engine"]
        pid = engine["pid"]
        assert engine["cuda_graphs"] is False and engine["graph_buckets"] == []  # CPU: decode runs eagerly
        assert engine["cpu_threads"] == auto_cpu_threads(usable_cores(), 1)  # model.cpu_threads unset: auto
        stream = client.stream([4, 5, 6], max_tokens=40, ignore_eos=True, temperature=0.9, seed=77, timeout=120)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 5:
                os.kill(pid, signal.SIGKILL)  # the engine dies mid-stream
        result = stream.result
        stats = client.stats()
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == reference.token_ids, "tokens lost, repeated or changed across the engine restart"
    assert result.token_ids == reference.token_ids and result.finish_reason == "length"
    assert [c.index for c in chunks if c.token_ids] == list(range(40))
    assert stats["engine_restarts"] >= 1 and stats["engine"]["pid"] != pid
    _wait_idle(daemon)

def test_sigterm_drains_in_flight_requests_then_exits_cleanly(demo, tmp_path):
    proc = DaemonProcess(tmp_path).start()
    results: list = []
    with proc.client() as client:
        worker = threading.Thread(target=lambda: results.append(client.generate(
            [3, 4, 5], max_tokens=40, temperature=0.0, ignore_eos=True, timeout=120)))
        worker.start()
        deadline = time.monotonic() + 30
        while client.stats()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.proc.send_signal(signal.SIGTERM)
        worker.join(120)
        with pytest.raises(LoraplexError) as err:
            client.generate([3, 4, 5], max_tokens=2, timeout=10)
        assert err.value.code.value in ("shutting_down", "unavailable")
    assert proc.stop() == 0, proc.log()
    assert results and results[0].finish_reason == "length" and len(results[0].token_ids) == 40
    assert not list(proc.runtime_dir.glob("*.sock"))
    assert "stopped" in proc.log()


def test_cli_generate_and_adapters(daemon, demo):
    import subprocess
    import sys

    env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(daemon.runtime_dir)}
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "generate", "--adapter", "qv-r8", "--max-tokens", "6",
                          "--ignore-eos", "Hello"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "6 tokens" in out.stderr
    listing = subprocess.run([sys.executable, "-m", "loraplex.cli", "adapters", "list"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "qv-r8" in listing.stdout
    bad = subprocess.run([sys.executable, "-m", "loraplex.cli", "generate", "--adapter", "nope", "x"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unknown_adapter" in bad.stderr


def test_max_tokens_past_the_context_is_refused_not_cut(daemon):
    """vLLM answers 400; the daemon refuses before any token, in every client, and None fills the context."""
    import subprocess
    import sys

    limit = 4096  # the demo model's context
    prompt = _prompts(1, seed=21)[0]
    with daemon.client() as client:
        with pytest.raises(LoraplexError) as refused:
            client.generate(prompt, max_tokens=limit - len(prompt) + 1, timeout=60)
        assert refused.value.code.value == "context_length_exceeded"
        assert f"at most {limit - len(prompt)} new tokens fit" in refused.value.message
        stream = client.stream("Once upon a time", max_tokens=limit, timeout=60)
        with pytest.raises(LoraplexError, match="context_length_exceeded"):
            next(stream)  # the first thing the stream yields is the refusal
        long_prompt = [3 + i % 500 for i in range(limit - 5)]
        filled = client.generate(long_prompt, max_tokens=None, temperature=0.0, ignore_eos=True, timeout=120)
        assert filled.finish_reason == "length" and len(filled.token_ids) == 5
    env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(daemon.runtime_dir)}
    out = subprocess.run([sys.executable, "-m", "loraplex.cli", "generate", "--stream", "--max-tokens", str(limit),
                          "Hello"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "context_length_exceeded" in out.stderr
    _wait_idle(daemon)


def test_raw_socket_bad_inputs_get_stable_codes(daemon):
    import msgpack

    from loraplex.ipc.codec import decode

    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"ipc://{daemon.runtime_dir}/client.sock")

    def next_reply():
        while True:  # skip the daemon's liveness probes (unsolicited pongs)
            assert raw.poll(30000), "no reply"
            msg = decode(raw.recv())
            if msg.TYPE != "pong":
                return msg

    def ask(body: bytes):
        raw.send(body)
        return next_reply()

    def generate(**fields) -> bytes:
        base = {"v": 1, "type": "generate", "request_id": "dup", "prompt_token_ids": [5, 6, 7],
                "max_tokens": 3000, "ignore_eos": True, "stream": False}
        return msgpack.packb({**base, **fields})

    try:
        assert ask(msgpack.packb({"v": 1, "type": "generate", "request_id": "t", "prompt_token_ids": [1],
                                  "temperature": -1.0})).code == "invalid_field"
        assert ask(msgpack.packb({"v": 9, "type": "ping"})).code == "unsupported_version"
        assert ask(msgpack.packb({"v": 1, "type": "launch_missiles"})).code == "unknown_type"
        assert ask(msgpack.packb({"v": 1, "type": "add_adapter", "name": "x", "path": "/x"})).code == "unknown_type"
        raw.send(generate())  # a long request under id "dup" ...
        time.sleep(0.2)
        dup = ask(generate(max_tokens=2))  # ... a second one with the same id is refused
        assert dup.code == "duplicate_request" and dup.request_id == "dup"
        raw.send(msgpack.packb({"v": 1, "type": "cancel", "request_id": "dup"}))
        done = next_reply()
        assert done.TYPE == "done" and done.finish_reason == "cancelled"
    finally:
        raw.close()
        ctx.term()
    _wait_idle(daemon)


@pytest.mark.parametrize("mode", ["cpu_assist", "cached"])
def test_adapter_load_modes_give_the_same_tokens(demo, tmp_path, mode):
    """cpu_assist (CPU workers compute early layers while a throttled load streams in) and
    cached (everything preloaded) must both reproduce the offline API's tokens."""
    prompts = _prompts(4, seed=17)
    prompts = [p * 3 for p in prompts]  # longer prefills so the CPU path has rows to work on
    adapters = ["all-r32", "mlp-r64", None, "qv-r8"]
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(adapters) - {None}:
        llm.add_adapter(name, demo.adapters[name])
    expected = llm.generate(prompts, adapters=adapters,
                            sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    env = {"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "3e6"} if mode == "cpu_assist" else {}
    proc = DaemonProcess(tmp_path, "--adapter-load-mode", mode, "--cpu-workers", "2", env=env).start()
    try:
        with proc.client() as client:
            got = [client.generate(p, adapter=a, max_tokens=6, temperature=0.0, ignore_eos=True, timeout=120)
                   for p, a in zip(prompts, adapters)]
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert stats["load_mode"] == mode
    paths = [g.timings["adapter_path"] for g in got]
    if mode == "cpu_assist":
        assert "cpu_assisted" in paths, (paths, stats.get("cpu_assist"))
        assert stats["cpu_assist"]["jobs"] > 0, stats["cpu_assist"]
    else:
        assert paths == ["cached", "cached", "base", "cached"]
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("lpx-")
                and p.split("-")[1] == proc.instance], "shared-memory segments left behind"


def test_stalled_cpu_worker_does_not_corrupt_or_hang_prefill(demo, tmp_path):
    prompt = _prompts(1, seed=23)[0] * 4
    llm = LLM(demo.model_dir, num_pages=600)
    llm.add_adapter("all-r32", demo.adapters["all-r32"])
    expected = llm.generate([prompt], adapters=["all-r32"],
                            sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    proc = DaemonProcess(tmp_path, "--adapter-load-mode", "cpu_assist", "--cpu-workers", "2",
                         env={"LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "2e6"}).start()
    stopped = None
    try:
        with proc.client() as client:
            workers = client.stats()["cpu_assist"]["workers"]
            stopped = workers[0]["pid"]
            os.kill(stopped, signal.SIGSTOP)  # a worker that hangs mid-job
            got = client.generate(prompt, adapter="all-r32", max_tokens=4, temperature=0.0, ignore_eos=True,
                                  timeout=120)
            assert got.token_ids == expected.token_ids
            assert got.timings["adapter_path"] == "cpu_assisted"
            deadline = time.monotonic() + 60
            while True:
                stats = client.stats()
                pids = [w["pid"] for w in stats["cpu_assist"]["workers"]]
                if stopped not in pids and all(w["ready"] for w in stats["cpu_assist"]["workers"]):
                    break
                assert time.monotonic() < deadline, f"stalled worker not replaced: {stats['cpu_assist']}"
                time.sleep(0.2)
            assert stats["cpu_timeouts"] >= 1
            again = client.generate(prompt, adapter="all-r32", max_tokens=4, temperature=0.0, ignore_eos=True,
                                    timeout=120)
            assert again.token_ids == expected.token_ids
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("policy", ["mlq", "dlora"])
def test_other_schedulers_serve_mixed_adapters_exactly(demo, tmp_path, policy):
    prompts = _prompts(6, seed=29)
    adapters = ["qv-r8", "qv-r8", None, "all-r32", "qv-r8", "mlp-r64"]
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(adapters) - {None}:
        llm.add_adapter(name, demo.adapters[name])
    expected = llm.generate(prompts, adapters=adapters,
                            sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    proc = DaemonProcess(tmp_path, "--scheduler", policy).start()
    try:
        async def run() -> list:
            async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
                return await asyncio.gather(*[
                    client.generate(p, adapter=a, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)
                    for p, a in zip(prompts, adapters)])

        got = asyncio.run(run())
        with AdminClient(runtime_dir=proc.runtime_dir) as admin:
            admin.set_policy("scheduler", "fcfs")  # switch at run time, then keep serving
            with pytest.raises(LoraplexError) as err:
                admin.set_policy("scheduler", "nope")
            assert err.value.code.value == "invalid_field"
        with proc.client() as client:
            after = client.generate(prompts[0], adapter=adapters[0], max_tokens=8, temperature=0.0,
                                    ignore_eos=True, timeout=120)
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    for exp, g in zip(expected, got):
        assert g.token_ids == exp.token_ids
    assert after.token_ids == expected[0].token_ids
    assert stats["scheduler"] == "fcfs"


def test_cache_hits_reload_by_name_and_eviction_under_kv_pressure(daemon, demo, tmp_path):
    import shutil

    from loraplex.gpu_engine.demo import write_random_adapter

    prompt = [11, 12, 13, 14]
    with daemon.client() as client:
        first = client.generate(prompt, adapter="rslora-r16", max_tokens=4, temperature=0.0, ignore_eos=True,
                                timeout=60)
        second = client.generate(prompt, adapter="rslora-r16", max_tokens=4, temperature=0.0, ignore_eos=True,
                                 timeout=60)
        assert first.token_ids == second.token_ids
        assert second.timings["adapter_path"] == "cached"  # a second request causes no load
        cache = client.stats()["cache"]
        assert cache["hits"] >= 1 and cache["policy"] == "lru"
    # Reload under the same name with new weights: the new weights are served, never a stale copy.
    import json

    config = json.loads((demo.model_dir / "config.json").read_text())
    new_dir = tmp_path / "reloaded"
    write_random_adapter(new_dir, config, rank=16, alpha=16, target_modules=["q_proj", "v_proj", "o_proj"],
                         seed=999, use_rslora=True)
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.add_adapter("swap", str(demo.adapters["rslora-r16"]))
    with daemon.client() as client:
        old = client.generate(prompt, adapter="swap", max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60)
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.remove_adapter("swap")
        admin.add_adapter("swap", str(new_dir))
    with daemon.client() as client:
        new = client.generate(prompt, adapter="swap", max_tokens=6, temperature=0.0, ignore_eos=True, timeout=60)
    llm = LLM(demo.model_dir, num_pages=200)
    llm.add_adapter("swap", new_dir)
    expected = llm.generate([prompt], adapters=["swap"],
                            sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert new.token_ids == expected.token_ids and new.token_ids != old.token_ids
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.remove_adapter("swap")
    shutil.rmtree(new_dir)


def test_replace_in_place_finishes_running_requests_on_old_weights_then_serves_new(daemon, demo, tmp_path):
    import json
    import shutil

    from loraplex.gpu_engine.demo import write_random_adapter

    live, fresh = tmp_path / "live", tmp_path / "fresh"
    shutil.copytree(demo.adapters["rslora-r16"], live)
    config = json.loads((demo.model_dir / "config.json").read_text())
    write_random_adapter(fresh, config, rank=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=4242)
    prompt = [21, 22, 23, 24, 25]
    llm = LLM(demo.model_dir, num_pages=200)
    llm.add_adapter("old", live)
    llm.add_adapter("new", fresh)
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    old_ref, new_ref = (o.token_ids for o in llm.generate([prompt, prompt], adapters=["old", "new"], sampling=sampling))
    assert old_ref != new_ref
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.add_adapter("inplace", str(live))
    replies: list[dict] = []
    with daemon.client() as client:
        stream = client.stream(prompt, adapter="inplace", max_tokens=24, temperature=0.0, ignore_eos=True,
                               timeout=120)
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 2:  # rewrite the files at the same path, then replace while the stream runs
                for name in ("adapter_config.json", "adapter_model.safetensors"):
                    shutil.copyfile(fresh / name, live / name)

                def replace() -> None:
                    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
                        replies.append(admin.add_adapter("inplace", str(live), replace=True))

                replacer = threading.Thread(target=replace)
                replacer.start()
        replacer.join(60)
        after = client.generate(prompt, adapter="inplace", max_tokens=24, temperature=0.0, ignore_eos=True,
                                timeout=120)
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        unchanged = admin.add_adapter("inplace", str(live), replace=True)
    with daemon.client() as client:
        cached = client.generate(prompt, adapter="inplace", max_tokens=24, temperature=0.0, ignore_eos=True,
                                 timeout=120)
    with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
        admin.remove_adapter("inplace")
    assert [t for c in chunks for t in c.token_ids] == old_ref, "a running request switched weights mid-stream"
    assert replies and replies[0]["changed"] is True
    assert after.token_ids == new_ref, "a stale cached copy was served after the replacement"
    assert unchanged["changed"] is False and cached.token_ids == new_ref
    assert cached.timings["adapter_path"] == "cached"


def test_eviction_under_kv_pressure_keeps_outputs_correct(demo, tmp_path):
    # A pool barely larger than one adapter plus one request: adapters must be evicted for KV and reloaded.
    names = ["all-r32", "mlp-r64", "attn-r16", "all-r32", "mlp-r64"]
    prompts = _prompts(len(names), seed=31)
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(names):
        llm.add_adapter(name, demo.adapters[name])
    expected = llm.generate(prompts, adapters=names,
                            sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    proc = DaemonProcess(tmp_path, "--cache-policy", "cost")
    proc.args = ["--num-pages", "70", "--max-num-seqs", "4", "--cache-policy", "cost"]
    proc.start()
    try:
        with proc.client() as client:
            got = [client.generate(p, adapter=a, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=120)
                   for p, a in zip(prompts, names)]
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert stats["cache"]["policy"] == "cost" and stats["cache"]["evictions"] >= 1


def test_per_client_limit_gets_a_fast_busy_reply(demo, tmp_path):
    proc = DaemonProcess(tmp_path, env={"LORAPLEX_SERVER_MAX_REQUESTS_PER_CLIENT": "2"}).start()
    try:
        async def run():
            async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
                return await asyncio.gather(*[
                    client.generate([5, 6, 7], max_tokens=30, temperature=0.0, ignore_eos=True, timeout=60)
                    for _ in range(5)], return_exceptions=True)

        results = asyncio.run(run())
        busy = [r for r in results if isinstance(r, LoraplexError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert len(served) >= 2 and busy and all(e.code.value == "overloaded" for e in busy)
        with proc.client() as client:  # the slots come back when requests finish
            assert len(client.generate([5, 6], max_tokens=2, timeout=60).token_ids) == 2
    finally:
        assert proc.stop() == 0, proc.log()


def test_vanished_client_of_a_non_streamed_request_is_noticed(daemon):
    import subprocess
    import sys

    code = (
        "import zmq, sys\n"
        "from loraplex.ipc.sockets import make_dealer\n"
        "from loraplex.ipc.protocol import GenerateRequest\n"
        f"s = make_dealer(zmq.Context(), 'ipc://{daemon.runtime_dir}/client.sock')\n"
        "s.send(GenerateRequest(request_id='gone', prompt_token_ids=[5, 6, 7], max_tokens=4000, ignore_eos=True))\n"
        "sys.stdout.write('sent\\n'); sys.stdout.flush()\n"
        "import time; time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "sent"
    deadline = time.monotonic() + 30
    while _kv_pages(daemon) == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    child.kill()  # the client process dies without cancelling
    child.wait()
    stats = _wait_idle(daemon, timeout_s=15)  # noticed by the probe, aborted, pages freed
    assert stats["running"] == 0
