"""A stub engine *process* for bench/daemon_overhead.py --stub-step-ms: the daemon's real
engine link, socket, plan codec and step loop, against an engine that sleeps instead of
computing.

It answers hello like an engine (a pool large enough for the benchmark's batch), takes
adapter orders, and runs each step plan by decoding it, sleeping LORAPLEX_STUB_STEP_MS and
sampling one token per row. It times what the daemon makes it wait: the interval between
the starts of two successive decode steps (a step starts once its plan is decoded) and the
plan's size on the wire. Those go, as JSON, to LORAPLEX_STUB_STATS when it exits.

Run by the daemon as `python -m bench.stub_engine_process` (bench/stub_engine.py's
StubProcessLink), with the repository root on PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import time

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.gpu_engine.child_process import run_child
from loraplex.ipc.engine_plan import RowResult, StepPlan, StepResult
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.order_pump import OrderPump
from loraplex.ipc.plan_delta import PlanBook
from loraplex.ipc.protocol import (
    EngineAdapterLoaded,
    EngineFailure,
    EngineHello,
    EngineLoadAdapter,
    EngineStep,
    EngineStepDelta,
    EngineStepDone,
    EngineUnloadAdapter,
    Message,
)
from loraplex.ipc.sockets import TypedSocket

ROLE = "loraplex-engine"  # the daemon's tools name children by role; this one stands in for an engine
STEP_MS_ENV = "LORAPLEX_STUB_STEP_MS"
STATS_ENV = "LORAPLEX_STUB_STATS"
MAX_MODEL_LEN_ENV = "LORAPLEX_STUB_MAX_MODEL_LEN"
STUB_TOKEN = 42
NUM_PAGES = 200_000  # 256 rows of 4096 tokens in 16-token pages, with room to spare
PAGE_TOKENS = 16


class StubEngine:
    def __init__(self, sock: TypedSocket, step_ms: float, max_model_len: int) -> None:
        self.sock = sock
        self.step_s = step_ms / 1e3
        self.max_model_len = max_model_len
        # Per decode step that followed a decode step: start to start, the plan's bytes, its rows.
        self.decode_intervals_ms: list[float] = []
        self.decode_plan_bytes: list[int] = []
        self.decode_rows: list[int] = []
        self.decode_idle_ms: list[float] = []  # end of the step before to start: the engine waited
        self._last_end: float | None = None
        self.plan_bytes: list[int] = []
        self.steps = 0
        self.book = PlanBook()  # the persistent batch, as a real engine keeps it
        self._last_decode_start: float | None = None

    def hello(self) -> EngineHello:
        return EngineHello(pid=os.getpid(), model_dir="/nonexistent-stub", device="stub", dtype="none",
                           vocab_size=512, num_layers=1, hidden_size=256, kv_dim=128,
                           max_model_len=self.max_model_len, num_pages=NUM_PAGES, page_tokens=PAGE_TOKENS,
                           page_elems=4096, eos_token_ids=[2])

    def serve(self) -> None:
        self.sock.send(self.hello())
        pump = OrderPump(self.sock, self.prepare).start()
        try:
            pump.serve(self.begin, self.handle)
        finally:
            pump.stop()

    def prepare(self, msg: Message, nbytes: int) -> object:
        """On the pump's thread, while the step before sleeps: the plan expanded, as an engine does."""
        if isinstance(msg, EngineStepDelta):
            try:
                return (self.book.expand(msg.delta), nbytes)
            except ValueError as exc:
                return EngineFailure(code=ErrorCode.ENGINE_FAILED.value, message=str(exc))
        if isinstance(msg, EngineStep):
            return (msg.plan, nbytes)
        return msg

    def begin(self, order: object) -> object:
        """Feed a step the tokens its rows sampled in the last one, as an engine does."""
        if isinstance(order, tuple):
            try:
                self.book.feed(order[0])
            except ValueError as exc:
                self.book.failed()
                return EngineFailure(code=ErrorCode.ENGINE_FAILED.value, message=str(exc))
        return order

    def handle(self, order: object) -> Message:
        if isinstance(order, tuple):
            plan, nbytes = order
            reply = self.step(plan, nbytes)
            self.book.sampled(reply.result)
            return reply
        if isinstance(order, (EngineLoadAdapter, EngineUnloadAdapter)):
            return EngineAdapterLoaded(name=order.name, rank=8, target_modules=["q_proj"], num_pages=1, nbytes=0)
        if isinstance(order, EngineFailure):
            return order
        return EngineFailure(code=ErrorCode.UNKNOWN_TYPE.value, message=f"stub engine cannot handle {order.TYPE}")

    def step(self, plan: StepPlan, nbytes: int) -> EngineStepDone:
        started = time.perf_counter()
        self.steps += 1
        self.plan_bytes.append(nbytes)
        decoding = bool(plan.rows) and all(len(r.token_ids) == 1 and r.sample for r in plan.rows)
        if decoding and self._last_decode_start is not None:
            self.decode_intervals_ms.append((started - self._last_decode_start) * 1e3)
            self.decode_plan_bytes.append(nbytes)
            self.decode_rows.append(len(plan.rows))
            self.decode_idle_ms.append((started - self._last_end) * 1e3)
        self._last_decode_start = started if decoding else None
        rows = [RowResult(request_id=r.request_id, token_id=STUB_TOKEN, logprob=None) for r in plan.rows if r.sample]
        if plan.rows:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - started)))
        self._last_end = time.perf_counter()
        return EngineStepDone(result=StepResult(step_id=plan.step_id, rows=rows,
                                                forward_ms=self.step_s * 1e3 if plan.rows else 0.0))

    def stats(self) -> dict:
        return {"steps": self.steps, "decode_intervals_ms": self.decode_intervals_ms,
                "decode_plan_bytes": self.decode_plan_bytes, "decode_rows": self.decode_rows,
                "decode_idle_ms": self.decode_idle_ms,
                "plan_bytes": self.plan_bytes}


def _start(spec: EngineSpec) -> EngineSpec:
    return spec


def _serve(spec: EngineSpec, sock: TypedSocket, demo: bool) -> None:
    engine = StubEngine(sock, float(os.environ.get(STEP_MS_ENV, "0")),
                        int(os.environ.get(MAX_MODEL_LEN_ENV, "4096")))
    try:
        engine.serve()
    finally:
        path = os.environ.get(STATS_ENV)
        if path:
            with open(path, "w") as out:
                json.dump(engine.stats(), out)


def main(argv: list[str] | None = None) -> int:
    return run_child(ROLE, "engine", argv, _start, _serve)


if __name__ == "__main__":
    raise SystemExit(main())
