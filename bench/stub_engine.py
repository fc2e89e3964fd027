"""Stub engines, injected through `run_daemon(engine_factory=...)` to measure the daemon's own
overhead; both speak the same messages as a real engine, so the daemon runs unchanged.

- StubEngineLink: no process; it answers every order at once (requests/s the daemon sustains).
- StubProcessLink: the real engine link to a stub engine process (bench/stub_engine_process.py)
  that sleeps a fixed time per step: what the control path between two steps costs.
"""
from __future__ import annotations

import os
from collections import deque

from loraplex.daemon.child_link import EngineDied
from loraplex.daemon.engine_link import EngineLink
from loraplex.ipc.engine_plan import RowResult, StepResult
from loraplex.ipc.protocol import (
    EngineAdapterLoaded,
    EngineHello,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDone,
    EngineUnloadAdapter,
    Message,
)

STUB_TOKEN = 42


class StubEngineLink:
    def __init__(self, ctx, runtime_dir, spec, **_: object) -> None:
        self.hello: EngineHello | None = None
        self.starts = 0
        self.submitted: deque[Message] = deque()  # orders sent whose replies the step loop has not collected
        self.outstanding = 0  # len(submitted), named as the engine link names it
        self.callers = 0  # as the engine link counts calls waiting for it: a stub call never waits

    def alive(self) -> bool:
        return self.hello is not None

    async def start(self) -> EngineHello:
        self.starts += 1
        self.submitted.clear()  # a restarted engine answers nothing sent to the one before
        self.outstanding = 0
        self.hello = EngineHello(pid=os.getpid(), model_dir="/nonexistent-stub", device="stub", dtype="none",
                                 vocab_size=512, num_layers=1, hidden_size=256, kv_dim=128, max_model_len=4096,
                                 num_pages=100_000, page_tokens=16, page_elems=4096, eos_token_ids=[2])
        return self.hello

    async def call(self, order: Message, timeout_s: float | None = None) -> Message:
        if isinstance(order, EngineStep):
            rows = [RowResult(request_id=r.request_id, token_id=STUB_TOKEN, logprob=None)
                    for r in order.plan.rows if r.sample]
            return EngineStepDone(result=StepResult(step_id=order.plan.step_id, rows=rows))
        if isinstance(order, (EngineLoadAdapter, EngineUnloadAdapter)):
            return EngineAdapterLoaded(name=order.name, rank=8, target_modules=["q_proj"], num_pages=1, nbytes=0)
        raise ValueError(f"stub engine cannot handle {order.TYPE}")

    async def submit(self, order: Message) -> None:
        """The step loop's send: the order runs (through `call`, which subclasses override) when collected."""
        if not self.alive():
            raise EngineDied("engine is not running")
        self.submitted.append(order)
        self.outstanding = len(self.submitted)

    async def collect(self, timeout_s: float | None = None) -> Message:
        if not self.submitted:
            raise RuntimeError("collect() without a submitted order")
        order = self.submitted.popleft()
        self.outstanding = len(self.submitted)
        return await self.call(order, timeout_s)

    async def stop(self) -> None:
        self.hello = None
        self.submitted.clear()
        self.outstanding = 0

    def describe(self) -> dict:
        return {"index": 0, "pid": os.getpid(), "alive": self.alive(), "starts": self.starts, "device": "stub"}


class StubProcessLink(EngineLink):
    """The daemon's engine link, its child the stub engine process (repository root on PYTHONPATH)."""

    CHILD_MODULE = "bench.stub_engine_process"
