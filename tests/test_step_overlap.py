"""The overlapped step loop (scheduler.overlap) against in-process engines that keep a persistent
batch and take steps ahead (submit / collect), as a process link does: every router, a dead
engine, co-migration, a running request migrated, an out-of-memory step and refused steps all
give each request exactly its tokens, with steps really in flight ahead."""
from __future__ import annotations

import asyncio
import random
from collections import deque

import pytest

from loraplex.daemon.child_link import EngineDied, EngineRefused
from loraplex.daemon.config_load import load_config
from loraplex.daemon.router import ROUTERS
from loraplex.daemon.serving import ServingCore
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.plan_delta import PlanBook
from loraplex.ipc.protocol import EngineFailure, EngineStep, EngineStepDelta
from tests.test_multi_engine import FakeEngine, PinToFirst, Recorder, expected, start, submit_all, wait_for


class AheadEngine(FakeEngine):
    """Takes step deltas ahead of their replies; steps run when collected, in order. Can refuse a
    step (out of memory, or a failure) or die after a number of steps."""

    PLAN_DELTAS = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.book = PlanBook()
        self.queued: deque = deque()
        self.outstanding = 0
        self.callers = 0
        self.max_ahead = 0  # most steps sent and not yet collected
        self.refuse: dict[int, str] = {}  # step number -> error code of its refusal
        self.refused = 0

    async def start(self):
        self.queued.clear()
        self.outstanding = 0
        self.book = PlanBook()
        return await super().start()

    async def submit(self, order) -> None:
        if self.hello is None:
            raise EngineDied("engine is not running")
        self.queued.append(order)
        self.outstanding += 1
        self.max_ahead = max(self.max_ahead, self.outstanding)

    async def collect(self, timeout_s=None):
        order = self.queued.popleft()
        self.outstanding -= 1
        if isinstance(order, EngineStepDelta):
            code = self.refuse.pop(self.steps + 1, None)
            try:
                plan = self.book.feed(self.book.expand(order.delta))
                # Out of memory with one request only would fail it (as it must): not injected there.
                if code is not None and (code != ErrorCode.OVERLOADED.value or len(plan.rows) > 1):
                    self.steps += 1
                    self.refused += 1
                    raise ValueError(f"injected {code}")
                code = None
            except ValueError as exc:
                self.book.failed()
                raise EngineRefused(EngineFailure(code=code or ErrorCode.ENGINE_FAILED.value, message=str(exc)))
            try:
                reply = await super().call(EngineStep(plan=plan))
            except EngineDied:
                self.queued.clear()
                self.outstanding = 0
                raise
            self.book.sampled(reply.result)
            return reply
        return await self.call(order)


def make_core(num_engines: int = 2, **overrides):
    config = load_config(None, env={}, overrides={"server.engines": num_engines, "scheduler.overlap": True,
                                                  **overrides})
    engines = [AheadEngine(None, None, {}, index=i) for i in range(num_engines)]
    recorder = Recorder()
    return ServingCore(config, engines, send=recorder.send), engines, recorder


def run_all(core_args: dict, n: int, max_tokens: int, prepare=None):
    async def run():
        core, engines, rec = make_core(**core_args)
        await start(core)
        if prepare is not None:
            prepare(core, engines)
        ids = await submit_all(core, n, max_tokens=max_tokens)
        await wait_for(rec, ids)
        snap = core.snapshot()
        await core.stop()
        return engines, rec, snap

    engines, rec, snap = asyncio.run(run())
    assert not rec.errors
    assert len(rec.done) == n and all(rec.tokens[rid] == expected(rid, max_tokens) for rid in rec.done)
    return engines, snap


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_every_router_with_steps_ahead_completes_exactly(router):
    engines, snap = run_all({"scheduler.router": router, "scheduler.max_num_seqs": 4}, 16, 6)
    assert max(e.max_ahead for e in engines) == 2, "steps should go out one ahead"
    assert sum(e["steps"] for e in snap["engines"]) == snap["steps"]


def test_a_dead_engine_with_steps_in_flight_loses_and_repeats_nothing():
    def kill(core, engines):
        engines[1].kill_after_steps = 4

    engines, snap = run_all({"scheduler.router": "most_idle", "scheduler.max_num_seqs": 4}, 12, 10, kill)
    assert snap["engine_restarts"] == 1 and engines[1].starts == 2


@pytest.mark.parametrize("seed", range(3))
def test_refused_and_out_of_memory_steps_take_back_the_steps_ahead(seed):
    rng = random.Random(seed * 31 + 7)

    def arm(core, engines):
        for engine in engines:
            for step in rng.sample(range(2, 30), 4):
                engine.refuse[step] = rng.choice([ErrorCode.OVERLOADED.value, ErrorCode.ENGINE_FAILED.value])

    engines, snap = run_all({"scheduler.router": "most_idle", "scheduler.max_num_seqs": 4}, 10, 12, arm)
    assert sum(e.refused for e in engines) >= 3, "the injected refusals should have come"


def test_dlora_co_migration_and_a_migrated_running_request_with_steps_ahead():
    async def run():
        core, engines, rec = make_core(2, **{"scheduler.router": "dlora", "scheduler.max_num_seqs": 2,
                                             "scheduler.rebalance_interval_s": 0.001})
        await start(core)
        core.engines.replicas.router = PinToFirst()
        ids = await submit_all(core, 16, max_tokens=8, prompt_len=40)
        core.set_router("dlora")
        await wait_for(rec, ids)
        key = b"client".hex() + "/r100"
        core.engines.replicas.router = PinToFirst()
        await core.submit(b"client", _request("r100", 30))
        while len(rec.tokens.get("r100", [])) < 5:
            await asyncio.sleep(0.001)
        core.migrate(key, 1)
        await wait_for(rec, ids + ["r100"])
        snap = core.snapshot()
        await core.stop()
        return rec, snap

    rec, snap = asyncio.run(run())
    assert not rec.errors
    assert all(rec.tokens[rid] == expected(rid, 8) for rid in rec.done if rid != "r100")
    assert rec.tokens["r100"] == expected("r100", 30)
    assert snap["migrations"] > 0


def _request(rid: str, max_tokens: int):
    from loraplex.ipc.protocol import GenerateRequest

    return GenerateRequest(request_id=rid, prompt_token_ids=[9] * 24, adapter=None, max_tokens=max_tokens,
                           ignore_eos=True, stream=True, temperature=0.0)


def test_idle_overlapped_loop_waits_without_polling():
    async def run():
        core, engines, rec = make_core(1)
        await start(core)
        ids = await submit_all(core, 3, max_tokens=4)
        await wait_for(rec, ids)
        steps = engines[0].steps
        await asyncio.sleep(0.2)  # nothing to do: no step, no busy loop
        idle_steps = engines[0].steps - steps
        await core.stop()
        return idle_steps

    assert asyncio.run(run()) == 0


def test_a_call_waits_for_every_step_submitted_before_it_takes_the_link(tmp_path):
    """An adapter order on a link with steps in flight: the call must not send until nothing is
    outstanding, even when a step is submitted between the last collect and the call's turn
    (its reply would otherwise be taken for the call's)."""
    from loraplex.daemon.engine_link import EngineLink

    async def run() -> list[str]:
        link = EngineLink(None, tmp_path, None)
        events: list[str] = []
        link.outstanding = 1  # a step in flight
        link._drained.clear()

        async def caller() -> None:
            await link._lock_drained()
            events.append(f"call sends with {link.outstanding} outstanding")
            link._lock.release()

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0)
        assert link.callers == 1
        link.outstanding = 0  # collected: drained ...
        link._drained.set()
        async with link._lock:  # ... and the step loop submits once more before the caller runs
            link.outstanding = 1
            link._drained.clear()
        for _ in range(5):
            await asyncio.sleep(0)
        events.append("second step collected")
        link.outstanding = 0
        link._drained.set()
        await task
        return events

    assert asyncio.run(run()) == ["second step collected", "call sends with 0 outstanding"]


def test_a_call_is_not_starved_by_a_loop_that_drains_and_submits_again(tmp_path):
    """The step loop drains for a waiting call and submits its next step at once, without
    yielding: the call still gets the link first."""
    from loraplex.daemon.engine_link import EngineLink

    async def run() -> list[str]:
        link = EngineLink(None, tmp_path, None)
        link._check_running = lambda: None  # no process: only the ordering is checked
        order: list[str] = []

        class Sock:
            async def send(self, msg, identity=None) -> None:
                order.append(msg)

        link._sock = Sock()
        link.outstanding = 1
        link._drained.clear()

        async def caller() -> None:
            await link._lock_drained()
            order.append("call")
            await asyncio.sleep(0)
            link._lock.release()

        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0)
        link.outstanding = 0  # the step loop collected ...
        link._drained.set()
        await link.submit("step")  # ... and submits again straight away
        await asyncio.wait_for(task, 5)  # (before the fix: the call waited for a drain that never came)
        return order

    assert asyncio.run(run()) == ["call", "step"]
