"""Several engines behind one serving core: routing, re-placement when an engine
dies, and request-adapter co-migration, with fake engines whose tokens depend
only on (request, token index) so a recomputed or migrated request must
continue exactly where it left off."""
from __future__ import annotations

import asyncio
import hashlib

import pytest

from bench.stub_engine import StubEngineLink
from loraplex.daemon.child_link import EngineDied
from loraplex.daemon.config_load import load_config
from loraplex.daemon.router import ROUTERS, Router
from loraplex.daemon.serving import Rejected, ServingCore
from loraplex.ipc.engine_plan import RowResult, StepResult
from loraplex.ipc.protocol import EngineStep, EngineStepDone, GenerateRequest

ADAPTERS = ["a", None, "b", "c"]


def token_for(request_id: str, index: int) -> int:
    digest = hashlib.blake2b(f"{request_id}:{index}".encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % 500


class FakeEngine(StubEngineLink):
    """Speaks the engine protocol; each step yields to the loop so engines interleave, and
    can die after a number of steps."""

    def __init__(self, ctx, runtime_dir, spec, *, index: int = 0, **_: object) -> None:
        super().__init__(ctx, runtime_dir, spec)
        self.index = index
        self.rows_seen: list[str] = []
        self.kill_after_steps: int | None = None
        self.steps = 0

    async def call(self, order, timeout_s=None):
        if self.hello is None:
            raise EngineDied("engine is not running")
        if isinstance(order, EngineStep):
            await asyncio.sleep(0.002)
            self.steps += 1
            if self.kill_after_steps is not None and self.steps >= self.kill_after_steps:
                self.kill_after_steps = None
                self.hello = None
                raise EngineDied("fake engine killed")
            self.rows_seen += [r.request_id for r in order.plan.rows]
            rows = [RowResult(request_id=r.request_id, token_id=token_for(r.request_id, r.sample_index), logprob=None)
                    for r in order.plan.rows if r.sample]
            return EngineStepDone(result=StepResult(step_id=order.plan.step_id, rows=rows))
        return await super().call(order, timeout_s)

    def describe(self) -> dict:
        return {**super().describe(), "index": self.index}


class Recorder:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, object] = {}
        self.errors: dict[str, object] = {}

    async def send(self, identity, msg) -> None:
        if msg.TYPE == "token":
            assert msg.index == len(self.tokens.setdefault(msg.request_id, [])), "gap or duplicate in the stream"
            self.tokens[msg.request_id].extend(msg.token_ids)
        elif msg.TYPE == "done":
            self.done[msg.request_id] = msg
        elif msg.TYPE == "error":
            self.errors[msg.request_id] = msg


def make_core(num_engines: int = 2, **overrides):
    config = load_config(None, env={}, overrides={"server.engines": num_engines, **overrides})
    engines = [FakeEngine(None, None, {}, index=i) for i in range(num_engines)]
    recorder = Recorder()
    return ServingCore(config, engines, send=recorder.send), engines, recorder


async def submit_all(core, n: int, *, max_tokens: int = 6, prompt_len: int = 24) -> list[str]:
    ids = []
    for i in range(n):
        rid = f"r{i:03d}"
        await core.submit(b"client", GenerateRequest(request_id=rid, prompt_token_ids=[5 + i % 7] * prompt_len,
                                                     adapter=ADAPTERS[i % len(ADAPTERS)], max_tokens=max_tokens,
                                                     ignore_eos=True, stream=True, temperature=0.0))
        ids.append(rid)
    return ids


async def wait_for(recorder: Recorder, ids: list[str], timeout_s: float = 20.0) -> None:
    async def finished() -> None:
        while len(recorder.done) + len(recorder.errors) < len(ids):
            await asyncio.sleep(0.005)

    await asyncio.wait_for(finished(), timeout_s)


def expected(rid: str, n: int) -> list[int]:
    key = b"client".hex() + "/" + rid
    return [token_for(key, i) for i in range(n)]


async def start(core) -> None:
    await core.start([])
    for name in sorted({a for a in ADAPTERS if a}):
        await core.add_adapter(name, f"/fake/{name}")


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_every_router_spreads_requests_and_each_completes_exactly(router):
    async def run():
        core, engines, rec = make_core(2, **{"scheduler.router": router, "scheduler.max_num_seqs": 4})
        await start(core)
        ids = await submit_all(core, 16)
        await wait_for(rec, ids)
        snap = core.snapshot()
        await core.stop()
        return engines, rec, snap

    engines, rec, snap = asyncio.run(run())
    assert not rec.errors
    for rid in rec.done:
        assert rec.tokens[rid] == expected(rid, 6)
    assert all(e.rows_seen for e in engines), "both engines must have served requests"
    assert snap["router"] == router and len(snap["engines"]) == 2
    assert sum(e["steps"] for e in snap["engines"]) == snap["steps"]


def test_requests_of_a_dead_engine_continue_on_the_other_without_loss_or_duplicates():
    async def run():
        core, engines, rec = make_core(2, **{"scheduler.router": "most_idle", "scheduler.max_num_seqs": 4})
        await start(core)
        engines[1].kill_after_steps = 3
        ids = await submit_all(core, 12, max_tokens=10)
        await wait_for(rec, ids)
        snap = core.snapshot()
        await core.stop()
        return engines, rec, snap

    engines, rec, snap = asyncio.run(run())
    assert not rec.errors
    assert all(rec.tokens[rid] == expected(rid, 10) for rid in rec.done) and len(rec.done) == 12
    assert snap["engine_restarts"] == 1 and engines[1].starts == 2
    assert snap["rerouted"] > 0, "requests of the dead engine should move to the healthy one"


class PinToFirst(Router):
    name = "pin_first"

    def choose(self, request, engines) -> int:
        return 0


def test_dlora_router_co_migrates_queued_requests_and_outputs_stay_exact():
    async def run():
        core, engines, rec = make_core(2, **{"scheduler.router": "dlora", "scheduler.max_num_seqs": 2,
                                             "scheduler.rebalance_interval_s": 0.001})
        await start(core)
        core.engines.replicas.router = PinToFirst()  # pile every request onto engine 0 ...
        ids = await submit_all(core, 16, max_tokens=8, prompt_len=40)
        core.set_router("dlora")  # ... then let the dlora router even the load out
        await wait_for(rec, ids)
        snap = core.snapshot()
        await core.stop()
        return engines, rec, snap

    engines, rec, snap = asyncio.run(run())
    assert not rec.errors
    assert all(rec.tokens[rid] == expected(rid, 8) for rid in rec.done) and len(rec.done) == 16
    assert snap["migrations"] > 0 and engines[1].rows_seen, "queued requests should have moved to engine 1"


def test_a_running_request_migrates_by_recompute_and_continues_at_the_same_token():
    async def run():
        core, engines, rec = make_core(2, **{"scheduler.router": "first_fit"})
        await start(core)
        core.engines.replicas.router = PinToFirst()
        key = b"client".hex() + "/r000"
        ids = await submit_all(core, 1, max_tokens=30)
        while len(rec.tokens.get("r000", [])) < 5:
            await asyncio.sleep(0.001)
        core.migrate(key, 1)  # carried out between two of engine 0's steps
        await wait_for(rec, ids)
        migrated = core.engines.replicas.migrated
        await core.stop()
        return engines, rec, migrated

    engines, rec, migrated = asyncio.run(run())
    assert rec.tokens["r000"] == expected("r000", 30)
    assert migrated == 1
    first_on_1 = engines[1].rows_seen.index(b"client".hex() + "/r000")
    assert first_on_1 == 0 and engines[0].rows_seen.count(b"client".hex() + "/r000") >= 5
    assert 5 <= len(engines[0].rows_seen) < 30, "it ran on engine 0 first, then finished on engine 1"


def test_unknown_router_is_refused_and_the_old_one_stays():
    async def run():
        core, _, _ = make_core(2)
        await start(core)
        with pytest.raises(Rejected) as err:
            core.set_router("round_robin")
        core.set_router("rank_aware")
        name = core.snapshot()["router"]
        await core.stop()
        return err.value, name

    err, name = asyncio.run(run())
    assert err.code == "invalid_field" and name == "rank_aware"


def _write_adapter(path, content: bytes):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(content)
    return str(path)


def test_replacing_an_adapter_waits_for_its_users_holds_new_requests_and_skips_same_content(tmp_path):
    old_dir = _write_adapter(tmp_path / "old", b"old weights")
    new_dir = _write_adapter(tmp_path / "new", b"new weights")
    same_dir = _write_adapter(tmp_path / "same", b"new weights")

    async def run():
        core, engines, rec = make_core(2)
        await start(core)
        await core.add_adapter("live", old_dir)
        loads: list[str] = []
        for engine in engines:
            real = engine.call

            async def spy(order, timeout_s=None, real=real):
                if order.TYPE == "engine_load_adapter":
                    loads.append(order.name)
                return await real(order, timeout_s)

            engine.call = spy
        await core.submit(b"client", GenerateRequest(request_id="long", prompt_token_ids=[7] * 8, adapter="live",
                                                     max_tokens=40, ignore_eos=True, stream=True))
        while len(rec.tokens.get("long", [])) < 3:
            await asyncio.sleep(0.001)
        replacing = asyncio.ensure_future(core.replace_adapter("live", new_dir))
        while not core.adapters.get("live").replacing:
            await asyncio.sleep(0.001)
        await core.submit(b"client", GenerateRequest(request_id="held", prompt_token_ids=[9] * 8, adapter="live",
                                                     max_tokens=4, ignore_eos=True, stream=True))
        held_while_replacing = core.held.waiting("live")
        assert not replacing.done()
        entry, changed = await replacing
        long_done_first = "long" in rec.done
        await wait_for(rec, ["long", "held"])
        again = await core.replace_adapter("live", same_dir)
        await core.stop()
        return entry, changed, again, held_while_replacing, long_done_first, loads, rec

    entry, changed, again, held, long_first, loads, rec = asyncio.run(run())
    assert changed and long_first, "the replacement waits until the old weights' users finished"
    assert held == [b"client".hex() + "/held"] and rec.tokens["held"] == expected("held", 4)
    assert rec.tokens["long"] == expected("long", 40)
    assert loads.count("live.replacing") == 1 and loads.count("live") == 2, loads  # probe, then each engine
    assert again == (entry, False) and entry.path == same_dir, "same content: nothing reloaded"


def test_rank_aware_reads_the_profile_file_and_a_bad_one_stops_the_daemon_cleanly(tmp_path):
    from loraplex.daemon.main import run_daemon
    from loraplex.daemon.router import KernelCost, PerfProfile

    path = tmp_path / "perf.json"
    PerfProfile(bgmv=KernelCost(0.5, 1.0, r2=0.99), mbgmv=KernelCost(0.25, 2.0, r2=0.98)).save(path)
    core, _, _ = make_core(2, **{"scheduler.router": "rank_aware", "scheduler.router_profile": str(path),
                                 "scheduler.router_kernel": "bgmv", "scheduler.tpt_slo_ms": 50.0})
    router = core.engines.replicas.router
    assert router.profile == PerfProfile.load(path) and router.kernel == "bgmv" and router.slo_ms == 50.0
    path.write_text('{"bgmv": {"alpha": -1, "beta": 0}}')
    config = load_config(None, env={}, overrides={"scheduler.router": "rank_aware",
                                                  "scheduler.router_profile": str(path),
                                                  "server.runtime_dir": str(tmp_path / "rt"),
                                                  "server.state_dir": str(tmp_path / "state")})
    assert asyncio.run(run_daemon(config, engine_factory=FakeEngine)) == 2
