"""MLQ (Chameleon §4.2): K-means queue fitting, square-root quotas, short requests not
stuck behind long ones, long ones never starved, bounded head-of-line bypass."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fcfs_scheduler import VOCAB, assert_drained, reference, request, worst_pages
from test_sched_common import FakeClock, TimedEngine, build, drive

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.scheduler.kmeans import choose_clusters, kmeans_1d
from loraplex.daemon.scheduler.mlq import MlqConfig, MlqScheduler, sqrt_shares


def test_kmeans_finds_separated_clusters_and_cuts_between_them() -> None:
    values = [1.0, 1.1, 0.9, 1.05] * 5 + [5.0, 5.2, 4.8] * 5 + [20.0, 21.0] * 5
    fit = choose_clusters(values, 4)
    assert fit.k == 3
    assert [round(c) for c in fit.centroids] == [1, 5, 20]
    assert 1.1 < fit.cutoffs[0] < 4.8 and 5.2 < fit.cutoffs[1] < 20.0
    assert choose_clusters([3.0] * 10, 4).k == 1
    assert choose_clusters([1.0, 1.2, 0.8, 1.1] * 5, 4).k == 1  # noise around one size is one queue
    assert choose_clusters([1.0, 1.1] * 5 + [9.0, 9.1] * 5, 4).k == 2
    assert kmeans_1d([1.0, 2.0], 4)[0] == (1.0, 2.0)  # never more clusters than distinct values


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=60), st.integers(1, 4))
def test_kmeans_fit_is_well_formed(values, k_max) -> None:
    fit = choose_clusters(values, k_max)
    assert 1 <= fit.k <= k_max
    assert list(fit.centroids) == sorted(fit.centroids) and list(fit.cutoffs) == sorted(fit.cutoffs)
    assert all(a >= b - 1e-6 * (1 + a) for a, b in zip(fit.wcss, fit.wcss[1:]))  # WCSS falls with K


def test_square_root_shares() -> None:
    shares = sqrt_shares([1.0, 9.0], 0.5)
    assert math.isclose(sum(shares), 1.0)
    assert math.isclose(shares[0], 0.5 * 0.1 + 0.5 * 0.25)  # load 0.1, spare ∝ sqrt: 1/(1+3)
    assert sqrt_shares([1.0, 9.0], 1.0) == [0.1, 0.9]  # saturated: each queue gets exactly its load
    assert sqrt_shares([0.0, 0.0], 0.5) == [0.5, 0.5]


def test_wrs_weights_and_queue_fit() -> None:
    clock = FakeClock()
    sched = build("mlq", 500, clock, mlq=MlqConfig(min_fit_samples=8))
    assert isinstance(sched, MlqScheduler) and sched.num_queues == 1
    # Equal means -> each normalised feature is 1 on average; the weights are A, B, C = 0.3, 0.5, 0.2.
    sched._scale = (10.0, 10.0, 10.0)
    assert math.isclose(sched.wrs(10, 10, 10), 1.0)
    assert sched.wrs(20, 10, 10) - 1.0 < sched.wrs(10, 10, 20) - 1.0 + 0.1 < sched.wrs(10, 20, 10) - 1.0 + 0.2
    engine = TimedEngine(sched, clock)
    for i in range(4):
        engine.add(request(f"s{i}", [1] * 2, 2))
        engine.add(request(f"l{i}", [1] * 120, 2, "cat"))
    assert sched.fits == 1 and 2 <= sched.num_queues <= 4 and math.isclose(sum(sched.shares), 1.0)
    assert sched.level_of("s0") < sched.level_of("l0")
    drive(engine, {})
    assert_drained(sched)


def _short_behind_long(policy: str) -> int:
    """Steps from a short request's arrival to its first token, behind six long prompts."""
    clock = FakeClock()
    sched = build(policy, 800, clock, max_batched_tokens=32, mlq=MlqConfig(min_fit_samples=8, refit_every=8))
    engine = TimedEngine(sched, clock)
    warmup = [request(f"w{i}", [1] * (160 if i % 2 else 4), 4) for i in range(8)]  # teaches MLQ both sizes
    drive(engine, {0: warmup})
    start = engine.steps
    longs = [request(f"long{i}", [2 + i] * 160, 4) for i in range(6)]
    drive(engine, {start: longs, start + 2: [request("short", [7] * 4, 4)]})
    assert_drained(sched)
    return engine.first_token["short"] - engine.arrived["short"]


def test_a_short_request_is_not_blocked_behind_long_ones() -> None:
    fcfs, mlq = _short_behind_long("fcfs"), _short_behind_long("mlq")
    assert fcfs >= 25  # FCFS: all 6 x 160 prompt tokens go first, 32 a step
    assert mlq <= 5  # MLQ: the short queue has its own quota from the first step


@st.composite
def long_among_shorts(draw):
    longs = [request(f"long{i}", draw(st.lists(st.integers(0, VOCAB - 1), min_size=20, max_size=60)),
                     draw(st.integers(1, 6)), draw(st.sampled_from([None, "cat"])), seed=i)
             for i in range(draw(st.integers(1, 2)))]
    period = draw(st.integers(1, 2))
    shorts = {}
    for k in range(0, 200, period):
        shorts[k] = [request(f"s{k}", draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
                             draw(st.integers(1, 4)), draw(st.sampled_from([None, "ada", "bob"])), seed=k)]
    return dict(longs=longs, long_at=draw(st.integers(0, 3)), shorts=shorts,
                max_batched_tokens=draw(st.integers(4, 24)), max_num_seqs=draw(st.integers(1, 4)),
                slack=draw(st.sampled_from([0, 8, 100])), cluster=draw(st.booleans()))


@settings(max_examples=20, deadline=None)
@given(long_among_shorts())
def test_long_requests_are_not_starved_by_a_stream_of_short_ones(w) -> None:
    geometry = PageGeometry(kv_dim=2, page_tokens=4, max_row_width=0)
    reqs = w["longs"] + [r for group in w["shorts"].values() for r in group]
    clock = FakeClock()
    sched = build("mlq", max(worst_pages(r, geometry, 4096) for r in reqs) + w["slack"], clock,
                  max_batched_tokens=w["max_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                  cluster_adapters=w["cluster"], mlq=MlqConfig(min_fit_samples=4, refit_every=8))
    engine = TimedEngine(sched, clock)
    arrivals = {k: list(v) for k, v in w["shorts"].items()}
    arrivals.setdefault(w["long_at"], []).extend(w["longs"])
    drive(engine, arrivals)
    for req in reqs:
        assert engine.seqs[req.request_id].output_ids == reference(req, 4096)[0], req.request_id
    last_short = max(engine.arrived[r.request_id] for r in reqs if r.request_id.startswith("s"))
    for req in w["longs"]:  # a long request starts while short ones still keep arriving
        assert engine.first_token[req.request_id] <= last_short, (req.request_id, engine.first_token, last_short)
    assert_drained(sched)


def _stream(adapters: str, lens: str, max_tokens: str) -> dict[int, list]:
    """One short request per step: its adapter (. a b), prompt length and max_tokens."""
    names = {".": None, "a": "ada", "b": "bob"}
    return {k: [request(f"s{k}", [1 + k % 7] * int(n), int(m), names[a], seed=k)]
            for k, (a, n, m) in enumerate(zip(adapters, lens, max_tokens))}


# Hypothesis examples of test_long_requests_are_not_starved_by_a_stream_of_short_ones, kept whole:
# the long requests (prompt length, max_tokens, adapter), the stream, and the scheduler's limits.
STARVED = {
    # Clustering passed the overdue "cat" head, once per queue it was refitted into (step 226).
    "seed11_clustering": dict(
        longs=[(60, 2, "cat")], num_pages=27, max_batched_tokens=13, stream=_stream(
            "......b.....a..b............b.a..a......b...a......b.baab.b.a..bbab..abab.b....a.a....abb..a.ab."
            "baba.ab.a.aabbb.aab..bba...a...aabbb....babaabb.aaba.abaaa.a..ab.ba.b..aab.babb.bbab.bab.bba..bbb.b.a.b.",
            "42112323112344341122411441124121424221114441141312413432134444113211442321124311121113112134341144"
            "114413142124421323224412331211242144133231444421113412344114231444113132442441422414444144141124114231",
            "32444414311214412314344232413241244442333213444134111213124323241342411212434141144422414333132133"
            "433233432214342311142231232441434232222214342332314341443313411233242212112323321441221212332122433141")),
    # Its deadline, set before the step-cost model had seen a step, was 4x too late (step 208).
    "seed106_prior_deadline": dict(
        longs=[(45, 4, None), (60, 5, "cat")], num_pages=20, max_batched_tokens=4, stream=_stream(
            ".....aa.babb.b..a.....bbbbbb.aa.....a.babbbbbbba..ab.a.a.aaab....aa.b..b.bab.a...baabbaa.aabab.aaabb.ab"
            "..bb.b.a.b.abb..a......baab..babaabaab...ab..b.....a.aababaabba.ab.ba....baa..aaab.aab..ab.bb...b",
            "42411342114124414313142141424114344414144414414134214124124313441324424244423443412411222343433412"
            "142314144241244421214111111112111214432242423412133144331444141141223442142343144111224442222311124313",
            "13441213144222241123341242342431134321413432412242241222234211144113441411341334342241134232231432"
            "123321134422434424212311111132312434244231122341433232143422113224312133341443412243112221212131412413")),
}


@pytest.mark.parametrize("name", sorted(STARVED))
def test_long_requests_start_while_the_stream_still_arrives(name) -> None:
    """One seat, adapter clustering on, a short request every step: each long request must start
    before the stream ends, as the property test asks."""
    w = STARVED[name]
    arrivals = {k: list(v) for k, v in w["stream"].items()}
    longs = [request(f"long{i}", [3] * n, m, adapter, seed=i) for i, (n, m, adapter) in enumerate(w["longs"])]
    arrivals[0].extend(longs)
    clock = FakeClock()
    sched = build("mlq", w["num_pages"], clock, max_batched_tokens=w["max_batched_tokens"], max_num_seqs=1,
                  cluster_adapters=True, mlq=MlqConfig(min_fit_samples=4, refit_every=8))
    engine = TimedEngine(sched, clock)
    drive(engine, arrivals)
    for req in longs:
        assert engine.first_token[req.request_id] <= max(arrivals), (req.request_id, engine.first_token)
    assert_drained(sched)


def test_head_of_line_bypass_is_bounded() -> None:
    clock = FakeClock()
    # One queue (no fit); a 20-page pool; page_tokens 4.
    sched = build("mlq", 20, clock, max_batched_tokens=64, mlq=MlqConfig(min_fit_samples=1000, max_bypass=2))
    engine = TimedEngine(sched, clock)
    engine.add(request("big", [1] * 60, 20))  # 15 pages, then grows
    sched.apply(plan := sched.schedule(), engine.execute(plan))
    engine.add(request("head", [2] * 28, 2))  # 7 pages: blocked while "big" runs
    for i in range(4):
        engine.add(request(f"small{i}", [3], 1))  # 1 page each
    # Every bypass predicted harmless (the head's expected wait is far away): still at most two.
    sched._deadline["head"] = clock.t + 1e6
    plan = sched.schedule()
    admitted = [r.request_id for r in plan.rows if r.request_id.startswith("small")]
    assert admitted == ["small0", "small1"]
    sched.apply(plan, engine.execute(plan))
    # Once the head is overdue nothing overtakes it at all.
    sched._bypassed.clear()
    sched._deadline["head"] = clock.t - 1.0
    plan = sched.schedule()
    assert not [r for r in plan.rows if r.request_id.startswith("small")]
    sched.apply(plan, engine.execute(plan))
    drive(engine, {})
    assert engine.first_token["head"] <= engine.first_token["small2"]
    assert_drained(sched)


def test_lanes_describe_each_queue_for_the_console() -> None:
    """The stats document's `queues` (the console's Queues panel): one row per MLQ queue, with
    its waiting requests, last plan's tokens against its share, oldest wait and WRS cut-off."""
    clock = FakeClock()
    sched = build("mlq", 800, clock, max_batched_tokens=32, mlq=MlqConfig(min_fit_samples=8))
    (lane,) = sched.lanes()  # one queue before the first fit
    assert lane == {"name": "q0", "depth": 0, "share": 1.0, "quota_used": 0, "quota_total": 32,
                    "oldest_wait_ms": None, "wrs_cutoff": None}
    engine = TimedEngine(sched, clock)
    for i in range(4):
        engine.add(request(f"s{i}", [1] * 2, 2))
        engine.add(request(f"l{i}", [1] * 120, 2, "cat"))
    clock.t += 0.25
    lanes = sched.lanes()
    assert [lane["name"] for lane in lanes] == [f"q{i}" for i in range(sched.num_queues)] and len(lanes) >= 2
    short, long = lanes[sched.level_of("s0")], lanes[sched.level_of("l0")]
    assert short["depth"] == long["depth"] == 4 and sum(lane["depth"] for lane in lanes) == 8
    assert short["oldest_wait_ms"] == long["oldest_wait_ms"] == pytest.approx(250.0)
    assert [lane["wrs_cutoff"] for lane in lanes] == [*sched.cutoffs, None]
    assert [lane["quota_total"] for lane in lanes] == [round(share * 32) for share in sched.shares]
    plan = sched.schedule()
    lanes = sched.lanes()
    assert sum(lane["quota_used"] for lane in lanes) == plan.num_tokens > 0
    for kind in "sl":  # each lane's tokens are its own requests' rows
        lane = lanes[sched.level_of(f"{kind}0")]
        assert lane["quota_used"] == sum(len(r.token_ids) for r in plan.rows if r.request_id[0] == kind) > 0
        assert lane["depth"] == 4 - sum(r.request_id[0] == kind for r in plan.rows)
