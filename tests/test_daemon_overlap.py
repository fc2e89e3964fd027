"""A live daemon with one step in flight ahead (scheduler.overlap = true), as real processes on
CPU: clients receive exactly the offline API's tokens, streams stop exactly at a stop token
or string and at max_tokens while other requests keep the batch busy, and run-time policy
switches (dLoRA's merge switches included), pause/resume and CPU-assisted prefill keep
working. (Engine faults under overlap: tests/test_faults.py; the simulator: test_sim_vs_live_daemon.py.)"""
from __future__ import annotations

import asyncio
import random

import pytest

from loraplex import LLM, SamplingParams
from loraplex.ipc.client import AdminClient, AsyncAdminClient, AsyncClient
from tests.daemon_process import DaemonProcess

OVERLAP = {"LORAPLEX_SCHEDULER_OVERLAP": "true"}
ADAPTERS = ["qv-r8", None, "all-r32", "mlp-r64", "qv-r8", "attn-r16"]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(4, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def offline(demo):
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(ADAPTERS) - {None}:
        llm.add_adapter(name, demo.adapters[name])

    def expected(prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> list[list[int]]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [r.token_ids for r in llm.generate(prompts, adapters=adapters, sampling=sampling)]

    return expected


async def _generate(proc: DaemonProcess, prompts, adapters, max_tokens: int, **kw) -> list:
    async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
        return await asyncio.gather(*[
            client.generate(p, adapter=a, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120, **kw)
            for p, a in zip(prompts, adapters)])


def test_streams_stop_exactly_while_the_batch_runs_ahead(demo, tmp_path, offline):
    prompts = _prompts(len(ADAPTERS), seed=random.randrange(1 << 20))
    free = offline(prompts, ADAPTERS, 14)
    proc = DaemonProcess(tmp_path, "--scheduler", "fcfs", env=OVERLAP).start()
    try:
        got = asyncio.run(_generate(proc, prompts, ADAPTERS, 14))
        assert [g.token_ids for g in got] == free
        assert all(g.finish_reason == "length" and g.usage["completion_tokens"] == 14 for g in got)

        async def mixed() -> tuple[list, list]:
            async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
                # Each stops at a token sampled mid-run while the others keep decoding: its row
                # in the step already planned ahead is wasted, never streamed.
                stops = [client.stream(p, adapter=a, max_tokens=14, temperature=0.0, ignore_eos=True, timeout=120,
                                       stop_token_ids=[f[3 + i % 6]]) for i, (p, a, f) in
                         enumerate(zip(prompts, ADAPTERS, free))]
                busy = [client.generate(p, adapter=a, max_tokens=14, temperature=0.0, ignore_eos=True, timeout=120)
                        for p, a in zip(prompts, ADAPTERS)]

                async def drain(stream) -> tuple[list, object]:
                    chunks = [c async for c in stream]
                    return chunks, stream.result

                done = await asyncio.gather(*[drain(s) for s in stops], *busy)
                return done[:len(stops)], done[len(stops):]

        stopped, busy = asyncio.run(mixed())
        assert [b.token_ids for b in busy] == free
        for i, ((chunks, result), full) in enumerate(zip(stopped, free)):
            stop_at = full.index(full[3 + i % 6])
            ids = [t for c in chunks for t in c.token_ids]
            assert ids == result.token_ids == full[:stop_at + 1], i  # nothing past the stop token
            assert [c.index for c in chunks if c.token_ids] == list(range(stop_at + 1))
            assert result.finish_reason == "stop"

        with proc.client() as client:
            whole = client.generate("Once upon", max_tokens=16, temperature=0.0, ignore_eos=True, timeout=60)
            needle = whole.text[len(whole.text) // 2:][:3]
            if needle.strip():
                cut = client.generate("Once upon", max_tokens=16, temperature=0.0, ignore_eos=True, stop=[needle],
                                      timeout=60)
                assert cut.finish_reason == "stop" and needle not in cut.text and whole.text.startswith(cut.text)
    finally:
        assert proc.stop() == 0, proc.log()


def test_policy_switches_merges_and_pause_keep_the_tokens_exact(demo, tmp_path, offline):
    prompts = _prompts(6, seed=random.randrange(1 << 20))
    adapters = ["qv-r8", "qv-r8", None, "all-r32", "qv-r8", "mlp-r64"]
    expected = offline(prompts, adapters, 10)
    proc = DaemonProcess(tmp_path, "--scheduler", "dlora", env=OVERLAP).start()
    try:
        async def run() -> list:
            async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
                tasks = [asyncio.create_task(client.generate(p, adapter=a, max_tokens=10, temperature=0.0,
                                                             ignore_eos=True, timeout=120))
                         for p, a in zip(prompts, adapters)]
                async with AsyncAdminClient(runtime_dir=proc.runtime_dir) as admin_client:
                    await asyncio.sleep(0.05)
                    await admin_client.pause()
                    await asyncio.sleep(0.1)
                    await admin_client.resume()
                with AdminClient(runtime_dir=proc.runtime_dir) as admin:
                    admin.set_policy("scheduler", "mlq")  # between two steps, while requests run
                    admin.set_policy("scheduler", "fcfs")
                return await asyncio.gather(*tasks)

        got = asyncio.run(run())
        with proc.client() as client:
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    assert [g.token_ids for g in got] == expected
    assert stats["scheduler"] == "fcfs"


def test_cpu_assisted_prefill_with_steps_ahead(demo, tmp_path, offline):
    prompts = [p * 3 for p in _prompts(4, seed=random.randrange(1 << 20))]
    adapters = ["all-r32", "mlp-r64", None, "qv-r8"]
    expected = offline(prompts, adapters, 6)
    proc = DaemonProcess(tmp_path, "--adapter-load-mode", "cpu_assist", "--cpu-workers", "2",
                         env={**OVERLAP, "LORAPLEX_MODEL_LOAD_THROTTLE_BYTES_S": "3e6"}).start()
    try:
        got = asyncio.run(_generate(proc, prompts, adapters, 6))
        with proc.client() as client:
            stats = client.stats()
    finally:
        assert proc.stop() == 0, proc.log()
    assert [g.token_ids for g in got] == expected
    assert "cpu_assisted" in [g.timings["adapter_path"] for g in got], stats.get("cpu_assist")
