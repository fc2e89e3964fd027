"""The simulator and a live CPU daemon — real sockets, a real engine process — make the same
scheduling decisions on the same trace. The daemon is paused while the trace is sent (so
every request is queued before the first step, as in the simulator, where they all arrive
at t=0) and writes its decisions to `--decision-log`."""
from __future__ import annotations

import asyncio
import time

import pytest

from loraplex.cli import main as cli_main
from loraplex.daemon.decision_log import read_decisions
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.simulator import SimConfig, simulate
from loraplex.daemon.sim.workload import RequestEvent, prompt_tokens
from loraplex.ipc.client import AdminClient
from loraplex.ipc.client_async import AsyncClient
from tests.daemon_process import DaemonProcess

# Demo adapters of three ranks, and the base model.
ADAPTERS = [("all-r32", 32), ("attn-r16", 16), (None, 0), ("qv-r8", 8)]
MAX_NUM_SEQS, MAX_BATCHED_TOKENS = 6, 256


def _trace(n: int) -> list[RequestEvent]:
    events = []
    for i in range(n):
        adapter, rank = ADAPTERS[i % len(ADAPTERS)]
        events.append(RequestEvent(request_id=f"r{i:03d}", arrival_s=0.0, adapter=adapter, rank=rank,
                                   prompt_len=20 + 37 * i % 300, output_len=3 + 5 * i % 17))
    return events


async def _send_all(daemon: DaemonProcess, events: list[RequestEvent]) -> list[str]:
    async with AsyncClient(runtime_dir=daemon.runtime_dir) as client:
        # One connection, requests created in trace order: the daemon queues them in that order.
        tasks = [asyncio.create_task(client.generate(prompt_tokens(e.request_id, e.prompt_len, vocab=200),
                                                     adapter=e.adapter,
                                                     max_tokens=e.output_len, ignore_eos=True, temperature=0.0,
                                                     request_id=e.request_id, timeout=120))
                 for i, e in enumerate(events)]
        deadline = time.monotonic() + 60
        while (await client.stats())["waiting"] < len(events):
            assert time.monotonic() < deadline, "the paused daemon did not queue every request"
            await asyncio.sleep(0.05)
        with AdminClient(runtime_dir=daemon.runtime_dir) as admin:
            assert admin.resume() == {"paused": False}
        results = await asyncio.gather(*tasks)
    return [r.finish_reason for r in results]


def _wait_until_host_warm(daemon: DaemonProcess, timeout_s: float = 60.0) -> None:
    """Start-up reads no adapter file; the host tier warms in the background. The simulator's
    adapters are all in host memory from the start, so the live run waits for that too."""
    deadline = time.monotonic() + timeout_s
    with daemon.client() as client:
        while client.stats()["adapter_counts"]["tiers"]["disk"] > 0:
            assert time.monotonic() < deadline, "the host tier never warmed"
            time.sleep(0.05)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_simulator_and_live_daemon_make_the_same_decisions(tmp_path, overlap):
    """With scheduler.overlap both plan each step before the one before it was applied."""
    events = _trace(24)
    live_log = tmp_path / "live.jsonl"
    daemon = DaemonProcess(tmp_path, "--device", "cpu", "--scheduler", "fcfs", "--max-num-seqs", str(MAX_NUM_SEQS),
                           "--max-batched-tokens", str(MAX_BATCHED_TOKENS), "--num-pages", "4000",
                           "--decision-log", str(live_log),
                           # The simulator runs cached (loads are free); live loads take real time,
                           # so waiting for them would make the decisions follow the clock.
                           env={"LORAPLEX_SCHEDULER_ADMIT_WHEN_LOADED": "false",
                                "LORAPLEX_SCHEDULER_OVERLAP": "true" if overlap else "false"}).start()
    try:
        _wait_until_host_warm(daemon)
        assert cli_main(["pause", "--runtime-dir", str(daemon.runtime_dir)]) == 0
        finish = asyncio.run(_send_all(daemon, events))
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert finish == ["length"] * len(events)

    profile = SimProfile(pool_pages=100_000, page_tokens=16, max_num_seqs=MAX_NUM_SEQS,
                         max_batched_tokens=MAX_BATCHED_TOKENS, max_model_len=4096)
    sim = simulate(events, SimConfig(policy="fcfs", mode="cached", prefetch=True, overlap=overlap), profile)
    simulated = [(d.admitted, d.rows) for d in sim.decisions]
    live = [(d.admitted, d.rows) for d in read_decisions(live_log)]
    assert len(simulated) > 5 and any(len(a) > 1 for a, _ in simulated)
    assert live == simulated
    if overlap:  # planning ahead changes the decisions on this trace: the test tells the loops apart
        sync = simulate(events, SimConfig(policy="fcfs", mode="cached", prefetch=True, overlap=False), profile)
        assert [(d.admitted, d.rows) for d in sync.decisions] != simulated
