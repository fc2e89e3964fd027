"""A long-running daemon keeps nothing per finished request or per engine step: the soak's
flat-memory requirement at the two places that once grew without bound."""
from __future__ import annotations

import asyncio
import gc
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import zmq.asyncio

from bench.stub_engine import StubEngineLink
from loraplex.daemon.config_load import load_config
from loraplex.daemon.engine_link import EngineLink
from loraplex.daemon.serving import ServingCore
from loraplex.ipc.protocol import ErrorReply, GenerateRequest


def _futures() -> int:
    return sum(isinstance(o, asyncio.Future) for o in gc.get_objects())


def test_engine_steps_leave_no_exit_waiter_behind() -> None:
    """Each order waits for the reply or the child's exit; the exit wait must not pile up."""

    class OneReplySocket:
        async def recv(self):
            return SimpleNamespace(identity=b"peer", message="reply")

    async def run() -> None:
        with tempfile.TemporaryDirectory() as runtime:
            link = EngineLink(zmq.asyncio.Context(), Path(runtime), {})
            link.proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
            link._sock = OneReplySocket()
            try:
                for _ in range(20):
                    assert await link._receive(5.0) == "reply"
                before = _futures()
                for _ in range(300):
                    await link._receive(5.0)
                gc.collect()
                assert _futures() - before < 10, "every step left a cancelled wait() in the process transport"
            finally:
                link.proc.kill()
                await link.proc.wait()

    asyncio.run(run())


def test_finished_requests_leave_no_deadline_timer_and_deadlines_still_fire() -> None:
    async def run() -> None:
        sent: list = []

        async def send(identity, msg):
            sent.append(msg)

        core = ServingCore(load_config(None, env={}), StubEngineLink(None, None, {}), send=send)
        await core.start([])

        def live_timers() -> int:
            return sum(isinstance(o, asyncio.TimerHandle) and getattr(o, "_callback", None) == core.requests.expire
                       for o in gc.get_objects())

        for i in range(40):
            await core.submit(b"client", GenerateRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7 + i],
                                                         max_tokens=2, ignore_eos=True, deadline_ms=600_000.0))
        for _ in range(500):
            if sum(m.TYPE == "done" for m in sent) == 40:
                break
            await asyncio.sleep(0.01)
        assert sum(m.TYPE == "done" for m in sent) == 40
        assert live_timers() == 0, "a finished request's deadline timer stays scheduled until its deadline"

        core.set_paused(True)  # queued, never run: the deadline must still end it
        await core.submit(b"client", GenerateRequest(request_id="late", prompt_token_ids=[5, 6], max_tokens=2,
                                                     deadline_ms=50.0))
        await asyncio.sleep(0.3)
        errors = [m for m in sent if isinstance(m, ErrorReply) and m.request_id == "late"]
        assert [e.code for e in errors] == ["timeout"]
        core.set_paused(False)
        await core.stop()

    asyncio.run(run())
