"""The cluster's pure parts, without Ray running: placement (the daemon's rank-aware policy
plus adapter affinity over replicas' routing stats), the cluster-wide stats sum, the wire
conversions, the settings, that a replica on a loopback node keeps Serve's gRPC server there,
and that the cluster package never imports torch."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from loraplex.cluster.config import ClusterConfig
from loraplex.cluster.placement import Placement, ReplicaView, rank_of
from loraplex.cluster.stats import Flight, FlightTable, aggregate, routing_stats
from loraplex.daemon.router import RankAwareRouter, RequestInfo
from loraplex.ipc.client_types import GenerateResult, StreamChunk
from loraplex.ipc.errors import ErrorCode, LoraplexError


def _stats(running=(), gpu=(), host=(), **extra) -> dict:
    return {"at": 0.0, "healthy": True, "running": [list(r) for r in running], "waiting": [], "gpu": list(gpu),
            "host": list(host), "ranks": {}, "step_ms": 0.0, "max_num_seqs": 256, **extra}


def test_placement_is_the_daemons_rank_aware_policy() -> None:
    # Toppings Fig. 6 (daemon/router/rank_aware.py): 24 rank-32 requests on one replica, 16 rank-64 on
    # the other, SLO 36 ms, a new rank-64 request: BGMV sends it to the rank-64 batch, MBGMV to the rank-32 one.
    a = ReplicaView("a", _stats(running=[("r32", 32, 100)] * 24, gpu=["r32", "r64"]))
    b = ReplicaView("b", _stats(running=[("r64", 64, 100)] * 16, gpu=["r32", "r64"]))
    request = RequestInfo("x", "r64", rank=64, prompt_len=8, max_tokens=100)
    bgmv = Placement(RankAwareRouter(kernel="bgmv", slo_ms=36.0))
    mbgmv = Placement(RankAwareRouter(kernel="mbgmv", slo_ms=36.0))
    assert bgmv.order(request, [a, b])[0] == 1
    assert mbgmv.order(request, [a, b])[0] == 0
    # the same decisions as the daemon's router on the same engines
    engines = [a.engine(0), b.engine(1)]
    assert RankAwareRouter(kernel="bgmv").choose(request, engines) == 1
    assert RankAwareRouter(kernel="mbgmv").choose(request, engines) == 0


def test_adapter_affinity_by_tier_then_last_replica() -> None:
    rng = random.Random()
    names = [f"replica-{rng.randrange(10**6)}-{i}" for i in range(3)]
    request = RequestInfo("x", "hot", rank=16, prompt_len=rng.randrange(1, 50), max_tokens=rng.randrange(1, 50))
    placement = Placement(miss_ms=20.0, host_miss_ms=5.0)
    views = [ReplicaView(names[0], _stats()), ReplicaView(names[1], _stats(host=["hot"])),
             ReplicaView(names[2], _stats(gpu=["hot"]))]
    assert placement.order(request, views) == [2, 1, 0]
    # nowhere resident: the replica it was last sent to wins the tie
    views = [ReplicaView(n, _stats(), last_for_adapter=(i == 1)) for i, n in enumerate(names)]
    assert placement.order(request, views)[0] == 1
    # a request sent since the replica's last report counts as bringing the adapter there
    views = [ReplicaView(names[0], _stats()), ReplicaView(names[1], _stats(), sent=[("hot", 16, 10)])]
    assert placement.order(request, views)[0] == 1
    # an adapter new to the cluster goes to the replica that is home to the fewest adapters
    views = [ReplicaView(names[0], _stats(), assigned=5), ReplicaView(names[1], _stats(), assigned=2),
             ReplicaView(names[2], _stats(), assigned=3)]
    assert placement.order(request, views)[0] == 1
    # an unhealthy replica comes last whatever it holds
    views = [ReplicaView(names[0], _stats(gpu=["hot"], healthy=False)), ReplicaView(names[1], _stats())]
    assert placement.order(request, views) == [1, 0]


def test_an_adapter_stays_home_when_the_other_replica_has_not_measured_its_steps() -> None:
    # The home replica has served: its steps are slow (a loaded CPU host) and it holds the adapter.
    # The other one has run nothing yet. Assuming it fast (no step time: no SLO miss there) sent the
    # adapter's next request away from its home; it must count as slow as the replicas that measured.
    rng = random.Random()
    request = RequestInfo("x", "hot", rank=16, prompt_len=rng.randrange(1, 50), max_tokens=rng.randrange(2, 50))
    home = _stats(gpu=["hot"], step_ms=rng.uniform(60.0, 200.0), tokens_per_s=rng.uniform(5.0, 50.0))
    views = [ReplicaView("idle", _stats(tokens_per_s=0.0)), ReplicaView("home", home, last_for_adapter=True)]
    assert Placement(RankAwareRouter(slo_ms=36.0)).order(request, views)[0] == 1


def test_a_hot_adapter_spreads_once_queued_deep_while_a_replica_idles() -> None:
    """dLoRA's proactive dispatch across replicas: affinity holds until the holder has
    spread_queue of the adapter's requests waiting and another replica has nothing."""
    placement = Placement(miss_ms=20.0, spread_queue=3)
    request = RequestInfo("x", "hot", rank=16, prompt_len=8, max_tokens=8)
    holder = _stats(gpu=["hot"])
    holder["waiting"] = [["hot", 16, 16]] * 2
    assert placement.order(request, [ReplicaView("a", holder, last_for_adapter=True),
                                     ReplicaView("b", _stats())])[0] == 0
    holder["waiting"] = [["hot", 16, 16]] * 3
    assert placement.order(request, [ReplicaView("a", holder, last_for_adapter=True),
                                     ReplicaView("b", _stats())])[0] == 1
    busy = _stats(running=[("other", 8, 4)])  # no replica idle: affinity stays
    assert placement.order(request, [ReplicaView("a", holder, last_for_adapter=True), ReplicaView("b", busy)])[0] == 0
    with pytest.raises(ValueError):
        Placement(spread_queue=0)


def test_rank_of_and_routing_stats() -> None:
    table = FlightTable()
    table.flights["a"] = Flight("x", prompt_len=10, max_tokens=20, generated=5, started=True)
    table.flights["b"] = Flight("y", prompt_len=7, max_tokens=3)
    snap = {"resident_adapters": ["x"], "host_tier": {"resident": ["y"]}, "pool": {"free": 3, "total": 9},
            "engines": [{"step_ms": 12.0, "tokens_per_s": 100.0}]}
    stats = routing_stats(table, snap, {"x": 8, "y": 64}, healthy=True)
    assert stats["running"] == [["x", 8, 15]] and stats["waiting"] == [["y", 64, 10]]
    assert stats["gpu"] == ["x"] and stats["host"] == ["y"] and stats["step_ms"] == 12.0
    assert rank_of("y", [{}, stats]) == 64 and rank_of(None, [stats]) == 0 and rank_of("z", [stats]) == 0


def test_aggregate_adds_replicas_up() -> None:
    rng = random.Random()
    runs = [rng.randrange(0, 9) for _ in range(3)]
    snaps = [{"running": r, "waiting": r + 1, "running_adapters": [f"a{r}"], "waiting_adapters": [],
              "max_loras_per_batch": 8 + r, "pool": {"total": 10, "kv": r}} for r in runs]
    total = aggregate(snaps)
    assert total is not None
    assert total["running"] == sum(runs) and total["waiting"] == sum(runs) + 3
    assert total["running_adapters"] == sorted({f"a{r}" for r in runs})
    assert total["max_loras_per_batch"] == 8 + min(runs) and total["pool"] == {"total": 30, "kv": sum(runs)}
    assert aggregate([]) is None


def test_wire_round_trips_and_validates() -> None:
    from loraplex.cluster import wire
    from loraplex.ipc.client import Choice, TopLogprobs
    from loraplex.ipc.errors import ProtocolError

    top = [TopLogprobs([1, 7], [-0.5, -1.5], ["a", "b"]), TopLogprobs([2, 9], [-0.25, -2.0], ["b", "c"])]
    chunk = StreamChunk("r", [1, 2], "ab", 0, [-0.5, -0.25], top, choice=1)
    assert wire.to_chunk(wire.chunk_event(chunk)["chunk"]) == chunk
    choices = [Choice(0, "ab", [1, 2], "length", [-0.5, -0.25], top), Choice(1, "b", [2], "stop")]
    result = GenerateResult("r", "ab", [1, 2], "length", {"prompt_tokens": 1}, {"e2e_ms": 3.0}, [-0.5, -0.25], top,
                            choices)
    assert wire.to_result(wire.result_event(result)["result"]) == result
    error = wire.to_error(wire.error_event(LoraplexError(ErrorCode.UNKNOWN_ADAPTER, "no such", "r"))["error"])
    assert error.code is ErrorCode.UNKNOWN_ADAPTER and error.message == "no such" and error.request_id == "r"
    assert wire.to_error({"code": "bogus"}).code is ErrorCode.INTERNAL
    with pytest.raises(ValueError, match="unknown generate options"):
        wire.request("hi", None, {"bogus": 1})
    with pytest.raises(ProtocolError):
        wire.request("hi", None, {"temperature": -1.0})


def test_cluster_config_parses_and_validates() -> None:
    config = ClusterConfig.from_dict({"replicas": "3", "router": "multiplex", "stats_period_s": "0.25",
                                      "daemon_args": "--num-pages 600"})
    assert config.replicas == 3 and config.stats_period_s == 0.25 and config.daemon_args == ("--num-pages", "600")
    assert ClusterConfig.from_dict(config.to_dict()) == config
    for bad in ({"replicas": 0}, {"router": "nope"}, {"http_port": 70000}, {"bogus": 1}, {"replicas": "x"},
                {"router_options": {"nope": 1}}, {"adapter_source": "gs://x/y"}):
        with pytest.raises(ValueError):
            ClusterConfig.from_dict(bad)
    assert not ClusterConfig(router="default").multiplexed and ClusterConfig().multiplexed


def test_the_cluster_package_never_imports_torch() -> None:
    pytest.importorskip("ray.serve")
    code = ("import sys, loraplex.cluster.app, loraplex.cluster.router, loraplex.cluster.cli; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_replica_on_a_loopback_node_binds_serves_grpc_server_there(monkeypatch) -> None:
    pytest.importorskip("ray.serve")
    import ray
    from ray.serve._private import replica

    from loraplex.cluster.loopback import confine_serve_replica

    bound: list[str] = []

    def add(server, address: str) -> int:
        bound.append(address)
        return 1

    monkeypatch.setattr(replica, "add_port_to_grpc_server", add)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    confine_serve_replica()  # a node others reach: Serve's own binding stays
    assert replica.add_port_to_grpc_server is add
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    confine_serve_replica()
    confine_serve_replica()  # once per process, however many constructors call it
    assert replica.add_port_to_grpc_server(None, "[::]:0") == 1
    replica.add_port_to_grpc_server(None, "[::]:7001")
    replica.add_port_to_grpc_server(None, "127.0.0.2:5")
    assert bound == ["127.0.0.1:0", "127.0.0.1:7001", "127.0.0.2:5"]


class _FakeGen:
    """Replays events; HANG: waits until cancelled (a request queued behind others)."""

    def __init__(self, events: list) -> None:
        self._events = list(events)
        self.cancelled = False

    async def __anext__(self):
        import asyncio

        if not self._events:
            raise StopAsyncIteration
        item = self._events.pop(0)
        if item is HANG:
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


HANG = object()


class _FakeReplicas:
    """A deployment handle whose successive generate calls replay the scripted event lists."""

    def __init__(self, *scripts: list) -> None:
        self._scripts = list(scripts)
        self.gens: list[_FakeGen] = []
        self.options_seen: list[dict] = []

    def options(self, **kw):
        self.options_seen.append(kw)
        return self

    @property
    def generate(self):
        return self

    def remote(self, payload):
        self.gens.append(_FakeGen(self._scripts.pop(0)))
        return self.gens[-1]


def _collect(stream) -> tuple[list[str], object]:
    import asyncio

    async def run():
        texts = []
        async for chunk in stream:
            texts.append(chunk.text)
        return texts

    return asyncio.run(run()), stream.result


def test_a_stream_is_sent_again_only_before_its_first_token() -> None:
    from loraplex.cluster import wire
    from loraplex.cluster.remote import ClusterStream

    chunk = wire.chunk_event(StreamChunk("r", [7], "a", 0))
    done = wire.result_event(GenerateResult("r", "a", [7], "length", {}, {}))
    lost = wire.error_event(LoraplexError(ErrorCode.UNAVAILABLE, "daemon gone"))
    # the first replica's daemon is gone before any token: the request goes out again and succeeds once
    replicas = _FakeReplicas([lost], [RuntimeError("actor died")], [chunk, done])
    texts, result = _collect(ClusterStream(replicas, wire.request("p", "ad", {}), "ad", None))
    assert texts == ["a"] and result is not None and len(replicas.gens) == 3
    assert replicas.options_seen[0] == {"stream": True, "multiplexed_model_id": "ad"}
    # after a token reached the client, a failure is an error, never a silent resend
    replicas = _FakeReplicas([chunk, RuntimeError("actor died")], [chunk, done])
    with pytest.raises(LoraplexError) as caught:
        _collect(ClusterStream(replicas, wire.request("p", None, {}), "", None))
    assert caught.value.code is ErrorCode.UNAVAILABLE and "after 1 chunks" in caught.value.message
    assert len(replicas.gens) == 1
    # a refusal that another replica would repeat is not retried
    refused = wire.error_event(LoraplexError(ErrorCode.UNKNOWN_ADAPTER, "no such adapter"))
    replicas = _FakeReplicas([refused], [chunk, done])
    with pytest.raises(LoraplexError) as caught:
        _collect(ClusterStream(replicas, wire.request("p", "x", {}), "x", None))
    assert caught.value.code is ErrorCode.UNKNOWN_ADAPTER and len(replicas.gens) == 1
    # a stream that ends without its result is an error too
    replicas = _FakeReplicas([chunk])
    with pytest.raises(LoraplexError, match="without a result"):
        _collect(ClusterStream(replicas, wire.request("p", None, {}), "", None))


def test_the_serve_router_counts_a_placement_when_it_makes_it() -> None:
    """Serve reports where a request went only when it ends, so the router counts its first
    choice at once (affinity for the next request of the adapter) and corrects it at the end."""
    pytest.importorskip("ray.serve")
    import asyncio
    from types import SimpleNamespace

    from loraplex.cluster import wire
    from loraplex.cluster.router import LoraplexRequestRouter

    router = object.__new__(LoraplexRequestRouter)  # Serve builds it with a live deployment; only its policy here
    router._replicas = {}
    router.initialize_state(slo_ms=1e6)
    from collections import namedtuple

    rid = namedtuple("rid", "unique_id")
    a, b = (SimpleNamespace(replica_id=rid(n), routing_stats={"at": 0.0}) for n in "ab")
    router._replicas = {a.replica_id: a, b.replica_id: b}

    def pending(n: int, adapter: str):
        return SimpleNamespace(args=[wire.request("hi", adapter, {"max_tokens": 4})], kwargs={},
                               metadata=SimpleNamespace(request_id=f"r{n}", internal_request_id=f"i{n}",
                                                        multiplexed_model_id=adapter))

    async def first(n: int, adapter: str):
        ranks = await router.choose_replicas([a, b], pending(n, adapter))
        assert ranks[0] == ranks[1]  # the first choice is probed twice before any other
        return ranks[0][0]

    home = asyncio.run(first(0, "x"))
    assert all(asyncio.run(first(n, "x")) is home for n in range(1, 4))
    other = b if home is a else a
    assert asyncio.run(first(9, "y")) is other  # a new adapter goes where fewer adapters live
    router._sent[other.replica_id].clear()  # y finished: the other replica is idle again
    # four of x queued at home (no report since) while the other idles: x spreads (dLoRA)
    assert asyncio.run(first(10, "x")) is other
    # a request of y really went to `home`: y's home follows it
    router.on_request_completed(home.replica_id, "i9")
    assert router._last["y"] == home.replica_id
    # requests that ended queue nowhere: one after another, z stays home with the other replica idle
    # and no report since (before, the ended ones counted as queued and z spread after four)
    router._sent.clear()
    z_home = asyncio.run(first(20, "z"))
    for n in range(21, 30):
        router.on_request_completed(z_home.replica_id, f"i{n - 1}")
        assert asyncio.run(first(n, "z")) is z_home


def test_a_queued_request_moves_once_while_another_replica_idles(monkeypatch) -> None:
    """dLoRA's migration at the ingress: a request that has no token yet on a replica with a deep
    queue of its adapter, while another replica idles, is taken back (its generator cancelled) and
    sent again, at most once; one whose first token came never moves."""
    import asyncio

    from loraplex.cluster import remote, wire
    from loraplex.cluster.remote import ClusterStream

    monkeypatch.setattr(remote, "MOVE_CHECK_S", 0.01)
    rng = random.Random()
    deep = rng.randrange(3, 8)
    placement = Placement(spread_queue=deep)
    queued = {"a": _stats(waiting=[["hot", 16, 10]] * deep), "b": _stats()}
    assert placement.should_move("hot", "a", queued)
    assert not placement.should_move("cold", "a", queued) and not placement.should_move(None, "a", queued)
    assert not placement.should_move("hot", "a", {**queued, "b": _stats(running=[["x", 8, 5]])})
    assert not placement.should_move("hot", "a", {**queued, "b": _stats(healthy=False)})
    assert not placement.should_move("hot", "a", {"a": _stats(waiting=[["hot", 16, 10]] * (deep - 1)), "b": _stats()})

    class Mover:
        asked: list = []

        async def should_move(self, adapter, replica):
            self.asked.append((adapter, replica))
            return placement.should_move(adapter, replica, queued)

    chunk = wire.chunk_event(StreamChunk("r", [7], "a", 0))
    done = wire.result_event(GenerateResult("r", "a", [7], "length", {}, {}))
    # queued on a: moves, lands on a again (the router chose it): no second move, it waits its turn
    replicas = _FakeReplicas([wire.accepted_event("a"), HANG], [wire.accepted_event("a"), chunk, done])

    async def run(stream):
        texts = [c.text async for c in stream]
        return texts, stream.result

    texts, result = asyncio.run(run(ClusterStream(replicas, wire.request("p", "hot", {}), "", None, mover=Mover())))
    assert texts == ["a"] and result is not None
    assert len(replicas.gens) == 2 and replicas.gens[0].cancelled and not replicas.gens[1].cancelled
    # once a token came, or for a replica the mover does not flag, the stream stays
    replicas = _FakeReplicas([wire.accepted_event("b"), chunk, done])
    texts, _ = asyncio.run(run(ClusterStream(replicas, wire.request("p", "hot", {}), "", None, mover=Mover())))
    assert texts == ["a"] and len(replicas.gens) == 1
    # a stream still waiting when its deadline passes times out, moving or not
    replicas = _FakeReplicas([wire.accepted_event("b"), HANG])
    with pytest.raises(LoraplexError) as caught:
        asyncio.run(run(ClusterStream(replicas, wire.request("p", "hot", {}), "", 0.2, mover=Mover())))
    assert caught.value.code is ErrorCode.TIMEOUT and replicas.gens[0].cancelled
