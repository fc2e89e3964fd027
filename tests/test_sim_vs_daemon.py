"""The simulator and the live daemon make the same scheduling decisions on the same trace:
both drive the daemon's own scheduler classes; only the clock and the engine differ."""
from __future__ import annotations

import asyncio

import pytest

from bench.stub_engine import StubEngineLink
from loraplex.daemon.config_load import load_config
from loraplex.daemon.serving import ServingCore
from loraplex.daemon.sim.profile import SimProfile
from loraplex.daemon.sim.simulator import SimConfig, simulate
from loraplex.daemon.sim.workload import RequestEvent, prompt_tokens
from loraplex.ipc.protocol import GenerateRequest

ADAPTERS = ["a", "b", None, "c"]


def _trace(n: int) -> list[RequestEvent]:
    events = []
    for i in range(n):
        adapter = ADAPTERS[i % len(ADAPTERS)]
        events.append(RequestEvent(request_id=f"r{i:03d}", arrival_s=0.0, adapter=adapter,
                                   rank=0 if adapter is None else 4,
                                   prompt_len=20 + 37 * i % 300, output_len=3 + 5 * i % 17))
    return events


def _daemon_decisions(events: list[RequestEvent], policy: str, max_num_seqs: int, max_batched_tokens: int):
    config = load_config(None, env={}, overrides={"scheduler.policy": policy, "scheduler.max_num_seqs": max_num_seqs,
                                                  "scheduler.max_batched_tokens": max_batched_tokens,
                                                  # the simulator runs cached: no adapter loads to wait for
                                                  "scheduler.admit_when_loaded": False})
    engine = StubEngineLink(None, None, {})
    decisions: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    real_call = engine.call

    async def recording_call(order, timeout_s=None):
        plan = getattr(order, "plan", None)
        if plan is not None and plan.rows:
            strip = lambda key: key.split("/", 1)[1]  # noqa: E731 - scheduler keys are identity/request id
            decisions.append((tuple(strip(r.request_id) for r in plan.rows if r.start_pos == 0),
                              tuple(strip(r.request_id) for r in plan.rows)))
        return await real_call(order, timeout_s)

    engine.call = recording_call
    finished: list[str] = []

    async def send(identity, msg):
        if msg.TYPE == "done":
            finished.append(msg.request_id)

    async def run():
        core = ServingCore(config, engine, send=send)
        await core.start([])
        for name in sorted({e.adapter for e in events if e.adapter}):
            await core.add_adapter(name, f"/stub/{name}")
        # Every request is queued before the step loop first runs (no await yields in between).
        for e in events:
            await core.submit(b"client", GenerateRequest(request_id=e.request_id,
                                                         prompt_token_ids=prompt_tokens(e.request_id, e.prompt_len,
                                                                                        vocab=200),
                                                         adapter=e.adapter, max_tokens=e.output_len, ignore_eos=True,
                                                         temperature=0.0))
        while len(finished) < len(events):
            await asyncio.sleep(0.01)
        await core.stop()

    asyncio.run(run())
    return decisions


# fcfs decides from the queue and the pool alone. mlq's bounded bypass and online predictor
# read the clock (expected waits, observed finish times), so its choices follow real time.
@pytest.mark.parametrize("policy", ["fcfs"])
def test_simulator_and_daemon_make_the_same_decisions(policy):
    events = _trace(24)
    max_num_seqs, max_batched_tokens = 6, 256
    profile = SimProfile(pool_pages=100_000, page_tokens=16, max_num_seqs=max_num_seqs,
                         max_batched_tokens=max_batched_tokens, max_model_len=4096)
    # the in-process stub engine keeps no persistent batch, so the daemon's loop runs synchronously
    sim = simulate(events, SimConfig(policy=policy, mode="cached", prefetch=True, overlap=False), profile)
    simulated = [(tuple(d.admitted), tuple(d.rows)) for d in sim.decisions]
    live = _daemon_decisions(events, policy, max_num_seqs, max_batched_tokens)
    assert len(simulated) > 5 and any(len(a) > 1 for a, _ in simulated)
    assert live == simulated
