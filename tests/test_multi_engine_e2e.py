"""A live two-engine daemon on CPU (real engine processes): mixed adapters come
back exactly as the offline API computes them under every router and every
scheduler, and a killed engine's requests finish on the other one."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.daemon.router import ROUTERS
from loraplex.daemon.scheduler.factory import POLICIES
from loraplex.ipc.client import AdminClient, AsyncClient
from tests.daemon_process import DaemonProcess

ADAPTERS = ["qv-r8", None, "all-r32", "mlp-r64", "qv-r8", "rslora-r16"]
MAX_TOKENS = 6


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(k),), generator=g).tolist() for k in torch.randint(4, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def reference(demo):
    prompts = _prompts(len(ADAPTERS), seed=41)
    llm = LLM(demo.model_dir, num_pages=600)
    for name in set(ADAPTERS) - {None}:
        llm.add_adapter(name, demo.adapters[name])
    outs = llm.generate(prompts, adapters=ADAPTERS,
                        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=[  # overlap: ~60 s more; engine faults under overlap run in test_faults
    pytest.param(False, id="sync"), pytest.param(True, id="overlap", marks=pytest.mark.slow)])
def two_engines(demo, tmp_path_factory, request):
    """Two engines, with the synchronous step loop and with one step in flight ahead (migrations,
    the dlora router's rebalancing and a killed engine then meet steps in flight)."""
    adapters = [f"--adapter={name}={path}" for name, path in demo.adapters.items()]
    proc = DaemonProcess(tmp_path_factory.mktemp("engines2"), "--model", str(demo.model_dir), *adapters,
                         "--engines", "2", "--max-num-seqs", "4",
                         env={"LORAPLEX_SCHEDULER_OVERLAP": "true" if request.param else "false"}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


async def _generate_all(proc, prompts) -> list[list[int]]:
    async with AsyncClient(runtime_dir=proc.runtime_dir) as client:
        outs = await asyncio.gather(*[
            client.generate(p, adapter=a, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=120)
            for p, a in zip(prompts, ADAPTERS * (len(prompts) // len(ADAPTERS)), strict=True)])
    return [o.token_ids for o in outs]


def test_every_router_and_scheduler_serves_mixed_adapters_exactly(two_engines, reference):
    prompts, expected = reference
    steps_before = [0, 0]
    # Each router once, the schedulers taking turns under them (every scheduler runs at least once),
    # switched at run time on the same daemon.
    for i, router in enumerate(sorted(ROUTERS)):
        policy = POLICIES[i % len(POLICIES)]
        with AdminClient(runtime_dir=two_engines.runtime_dir) as admin:
            admin.set_policy("router", router)
            admin.set_policy("scheduler", policy)
        got = asyncio.run(_generate_all(two_engines, prompts * 2))
        assert got == expected * 2, f"router {router}, scheduler {policy}: tokens differ from the offline API"
    with two_engines.client() as client:
        stats = client.stats()
    engines = stats["engines"]
    assert len(engines) == 2 and all(e["alive"] for e in engines)
    assert all(e["steps"] > before for e, before in zip(engines, steps_before)), "both engines must have served"
    assert stats["router"] == sorted(ROUTERS)[-1]
    assert stats["scheduler"] == POLICIES[(len(ROUTERS) - 1) % len(POLICIES)]


def test_a_killed_engine_s_requests_finish_on_the_other_engine(two_engines, reference):
    prompts, expected = reference
    with AdminClient(runtime_dir=two_engines.runtime_dir) as admin:
        admin.set_policy("router", "most_idle")
        admin.set_policy("scheduler", "fcfs")
    with two_engines.client() as client:
        before = client.stats()
    victim = before["engines"][1]["pid"]

    async def run() -> list[list[int]]:
        async with AsyncClient(runtime_dir=two_engines.runtime_dir) as client:
            tasks = [asyncio.ensure_future(client.generate(p, adapter=a, max_tokens=MAX_TOKENS, temperature=0.0,
                                                           ignore_eos=True, timeout=120))
                     for p, a in zip(prompts * 2, ADAPTERS * 2)]
            await asyncio.sleep(0.05)
            os.kill(victim, signal.SIGKILL)  # one engine dies with requests in flight
            return [o.token_ids for o in await asyncio.gather(*tasks)]

    got = asyncio.run(run())
    assert got == expected * 2, "requests lost or changed when an engine died"
    with two_engines.client() as client:
        after = client.stats()
    assert after["engine_restarts"] == before["engine_restarts"] + 1
    assert after["engines"][1]["pid"] != victim and after["engines"][0]["pid"] == before["engines"][0]["pid"]
