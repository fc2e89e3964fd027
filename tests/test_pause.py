"""Admin pause: a paused daemon accepts and queues requests but starts no step; resume
runs them; a drain resumes a paused daemon so what it holds can finish."""
from __future__ import annotations

import asyncio

from bench.stub_engine import StubEngineLink
from loraplex.daemon.config_load import load_config
from loraplex.daemon.serving import ServingCore
from loraplex.ipc.protocol import GenerateRequest


def _core(sent: list):
    engine = StubEngineLink(None, None, {})
    steps = []
    real_call = engine.call

    async def counting_call(order, timeout_s=None):
        if getattr(order, "plan", None) is not None:
            steps.append(order.plan.step_id)
        return await real_call(order, timeout_s)

    engine.call = counting_call

    async def send(identity, msg):
        sent.append(msg)

    return ServingCore(load_config(None, env={}), engine, send=send), steps


def _done(sent: list) -> int:
    return sum(m.TYPE == "done" for m in sent)


async def _started_paused(n: int):
    """A started core, paused, holding `n` submitted requests; (core, steps seen, messages sent)."""
    sent: list = []
    core, steps = _core(sent)
    await core.start([])
    core.set_paused(True)
    await _submit(core, n)
    return core, steps, sent


async def _submit(core: ServingCore, n: int) -> None:
    for i in range(n):
        await core.submit(b"client", GenerateRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7 + i],
                                                     max_tokens=3, ignore_eos=True, temperature=0.0))


def test_paused_daemon_queues_and_resume_runs_everything() -> None:
    async def run():
        core, steps, sent = await _started_paused(5)
        await asyncio.sleep(0.2)
        assert steps == [] and core.snapshot()["waiting"] == 5 and core.snapshot()["paused"] is True
        core.set_paused(False)
        for _ in range(200):
            if _done(sent) == 5:
                break
            await asyncio.sleep(0.01)
        assert _done(sent) == 5 and steps
        assert core.snapshot()["paused"] is False
        await core.stop()

    asyncio.run(run())


def test_drain_resumes_a_paused_daemon() -> None:
    async def run():
        core, _, sent = await _started_paused(2)
        assert await core.drain(5.0) is True
        assert core.controls.paused is False and _done(sent) == 2
        await core.stop()

    asyncio.run(run())
