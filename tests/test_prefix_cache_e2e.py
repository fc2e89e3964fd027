"""The prefix cache on a real daemon (random demo model, CPU): a repeated long prompt reuses
its cached pages and gives the same greedy tokens and logprobs as the first time; a prefix
never crosses adapters; usage and stats report the cached tokens; on_demand and cpu_assist."""
from __future__ import annotations

import asyncio
import random

import pytest

from loraplex.gpu_engine.demo import demo_model_config
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.ipc.client import AdminClient, AsyncClient
from tests.daemon_process import DaemonProcess
from tests.tolerances import forward_tolerance

PAGE_TOKENS = 16
DEMO_TOL = forward_tolerance(ModelConfig.from_hf(demo_model_config()))  # logprobs of two forwards


def _prompt(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def _generate(daemon: DaemonProcess, prompt: list[int], adapter: str | None):
    async with AsyncClient(runtime_dir=daemon.runtime_dir) as client:
        return await client.generate(prompt, adapter=adapter, max_tokens=8, temperature=0.0, ignore_eos=True,
                                     logprobs=True, timeout=120)


@pytest.mark.parametrize("mode", ["on_demand", "cpu_assist"])
def test_a_repeated_prompt_reuses_its_prefix_and_gives_the_same_tokens(demo, tmp_path, mode) -> None:
    flags = ["--adapter-load-mode", mode] + (["--cpu-workers", "2"] if mode == "cpu_assist" else [])
    daemon = DaemonProcess(tmp_path, *flags).start()
    try:
        prompt = _prompt(1)
        first = asyncio.run(_generate(daemon, prompt, "qv-r8"))
        again = asyncio.run(_generate(daemon, prompt, "qv-r8"))
        assert first.usage["cached_tokens"] == 0
        # Every full page but the one holding the last prompt token comes from the cache.
        assert again.usage["cached_tokens"] == (len(prompt) - 1) // PAGE_TOKENS * PAGE_TOKENS
        assert again.token_ids == first.token_ids and again.text == first.text
        assert again.logprobs == pytest.approx(first.logprobs, abs=DEMO_TOL)

        other = asyncio.run(_generate(daemon, prompt, "all-r32"))  # same tokens, another adapter
        base = asyncio.run(_generate(daemon, prompt, None))
        assert other.usage["cached_tokens"] == 0 and base.usage["cached_tokens"] == 0
        assert other.token_ids != first.token_ids or base.token_ids != first.token_ids

        # A longer conversation turn extends the cached prompt.
        turn = prompt + again.token_ids + _prompt(2, 20)
        extended = asyncio.run(_generate(daemon, turn, "qv-r8"))
        assert extended.usage["cached_tokens"] >= len(prompt) // PAGE_TOKENS * PAGE_TOKENS

        with daemon.client() as c:
            stats = c.stats()
        prefix = stats["prefix_cache"]
        assert prefix["hit_tokens"] == again.usage["cached_tokens"] + extended.usage["cached_tokens"]
        assert prefix["query_tokens"] >= 4 * len(prompt) and prefix["pages"] > 0
        assert stats["pool"]["kv"] == 0 and stats["pool"]["prefix_cache"] == prefix["idle_pages"] > 0
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_replacing_an_adapter_drops_its_cached_prefixes(demo, tmp_path) -> None:
    daemon = DaemonProcess(tmp_path).start()
    try:
        prompt = _prompt(3)
        asyncio.run(_generate(daemon, prompt, "attn-r16"))
        with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
            admin.add_adapter("attn-r16", str(demo.adapters["all-r32"]), replace=True)
        replaced = asyncio.run(_generate(daemon, prompt, "attn-r16"))
        assert replaced.usage["cached_tokens"] == 0  # computed again with the new weights
    finally:
        assert daemon.stop() == 0, daemon.log()


def _mixed_run(demo, root, *, prefix_cache: bool) -> tuple[list, dict]:
    env = {"LORAPLEX_SCHEDULER_PREFIX_CACHE": "true" if prefix_cache else "false"}
    root.mkdir()
    daemon = DaemonProcess(root, "--num-pages", "140", env=env).start()
    rng = random.Random(21)
    systems = [_prompt(100 + i, 70) for i in range(3)]
    adapters = [None, "qv-r8", "all-r32", "mlp-r64"]
    waves = [[(systems[i % 3] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))], adapters[i % 4])
              for i in range(12)] for _ in range(2)]

    async def run() -> list:
        async with AsyncClient(runtime_dir=daemon.runtime_dir) as client:
            out = []
            for wave in waves:
                out += await asyncio.gather(*[
                    client.generate(p, adapter=a, max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True,
                                    timeout=180) for p, a in wave])
            return out

    try:
        results = asyncio.run(run())
        with daemon.client() as c:
            stats = c.stats()
    finally:
        assert daemon.stop() == 0, daemon.log()
    return results, stats


def test_tokens_and_logprobs_are_the_same_with_the_prefix_cache_on_and_off(demo, tmp_path) -> None:
    """Mixed adapters and base rows sharing system prompts, in a pool tight enough to preempt
    and evict: the prefix cache changes what is computed, never what is sampled."""
    on, on_stats = _mixed_run(demo, tmp_path / "on", prefix_cache=True)
    off, off_stats = _mixed_run(demo, tmp_path / "off", prefix_cache=False)
    assert off_stats["prefix_cache"] is None
    assert on_stats["prefix_cache"]["hit_tokens"] > 0
    # A preempted request finds its own pages again: counted as hits, not as its cached_tokens.
    assert on_stats["prefix_cache"]["hit_tokens"] >= sum(r.usage["cached_tokens"] for r in on) > 0
    assert on_stats["preemptions"] + on_stats["adapter_evictions"] > 0, "the pool was not tight"
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=DEMO_TOL)


def test_n_siblings_share_the_prompt_and_penalised_requests_compute_it(demo, tmp_path) -> None:
    """n = 3 computes the prompt once (two siblings reuse the first one's pages); a request with
    a penalty, whose sampler needs every token it has seen, never starts from cached pages."""
    daemon = DaemonProcess(tmp_path).start()
    prompt = _prompt(9)

    async def run():
        async with AsyncClient(runtime_dir=daemon.runtime_dir) as client:
            both = await client.generate(prompt, adapter="qv-r8", max_tokens=6, temperature=0.0, ignore_eos=True,
                                         n=3, timeout=120)
            penalised = [await client.generate(prompt, adapter="qv-r8", max_tokens=6, temperature=0.0,
                                               ignore_eos=True, repetition_penalty=1.3, timeout=120)
                         for _ in range(2)]
            return both, penalised

    try:
        both, penalised = asyncio.run(run())
        with daemon.client() as c:
            prefix = c.stats()["prefix_cache"]
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert len(both.choices) == 3 and len({tuple(c.token_ids) for c in both.choices}) == 1  # greedy
    assert prefix["hit_tokens"] == 2 * ((len(prompt) - 1) // PAGE_TOKENS * PAGE_TOKENS)
    assert [r.usage["cached_tokens"] for r in penalised] == [0, 0]
    assert penalised[0].token_ids == penalised[1].token_ids
