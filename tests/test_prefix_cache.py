"""The prefix cache (daemon/memory/prefix_cache.py) alone and inside the scheduler: exact keys
per adapter, leaves-first LRU eviction, reference counts under random operations, and every
policy giving the reference tokens while requests share prompt prefixes in a tight pool
(the fake engine checks that every position's KV was computed with the same adapter from the
same tokens)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.contracts.geometry import PageGeometry
from loraplex.daemon.memory.allocator import ADAPTER, KV, PageAllocator
from loraplex.daemon.memory.prefix_cache import PrefixCache
from loraplex.daemon.scheduler.config import SchedulerConfig
from loraplex.daemon.scheduler.factory import make_scheduler
from tests.test_fcfs_scheduler import ADAPTER_PAGES, FakeEngine, assert_drained, reference, request

PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def cache(num_pages: int = 64) -> tuple[PrefixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return PrefixCache(alloc, PAGE, Clock()), alloc


def computed(prefix: PrefixCache, alloc: PageAllocator, adapter: str | None, tokens: list[int]) -> list[int]:
    """A sequence that computed `tokens` on fresh pages after matching what was cached."""
    pages = prefix.match(adapter, tokens)
    pages += alloc.allocate(-(-len(tokens) // PAGE) - len(pages), KV)
    start = len(prefix.match(adapter, tokens))  # (a second match is a second reference: undo it)
    prefix.release(pages[:start])
    full = len(tokens) // PAGE
    assert prefix.insert(adapter, pages, start, tokens[start * PAGE:full * PAGE]) == full
    return pages


def test_a_prefix_is_found_again_only_with_its_adapter_and_tokens() -> None:
    prefix, alloc = cache()
    rng = random.Random(7)
    tokens = [rng.randrange(3, 500) for _ in range(4 * PAGE + 2)]
    pages = computed(prefix, alloc, "cat", tokens)
    assert prefix.num_pages == 4 and prefix.idle_pages == 0
    alloc.free(prefix.release(pages))
    assert prefix.idle_pages == 4 and alloc.num_free == 64 - 4
    assert prefix.match("cat", tokens) == pages[:4]
    assert prefix.match("bob", tokens) == [] and prefix.match(None, tokens) == []
    assert prefix.match("cat", tokens, variant=True) == []  # merged weights: cached apart
    other = tokens[:PAGE + 1] + [tokens[PAGE + 1] + 1] + tokens[PAGE + 2:]
    assert prefix.match("cat", other) == pages[:1]  # diverges in the second page
    # At least the last token is computed: a prompt of exactly two full pages reuses one.
    assert prefix.match("cat", tokens[:2 * PAGE]) == pages[:1]
    assert prefix.counters.hit_tokens == (4 + 1 + 1) * PAGE


def test_eviction_takes_least_recently_used_leaves_first() -> None:
    prefix, alloc = cache()
    a = computed(prefix, alloc, None, list(range(3, 3 + 3 * PAGE)))
    b = computed(prefix, alloc, None, list(range(100, 100 + 2 * PAGE)))
    alloc.free(prefix.release(a))
    alloc.free(prefix.release(b))
    assert prefix.idle_pages == 5
    assert prefix.match(None, list(range(100, 100 + 2 * PAGE + 1))) == b  # b is used again: a is older
    alloc.free(prefix.release(b))
    assert prefix.evict(2) == 2
    assert prefix.match(None, list(range(3, 3 + 3 * PAGE + 1))) == a[:1]  # a's leaves left, its root stayed
    alloc.free(prefix.release(a[:1]))
    assert prefix.evict(10) == 3 and prefix.num_pages == 0 and alloc.num_free == 64


def test_a_referenced_page_and_a_page_with_cached_children_are_never_evicted() -> None:
    prefix, alloc = cache()
    pages = computed(prefix, alloc, None, list(range(3, 3 + 3 * PAGE)))
    assert prefix.evict(3) == 0
    alloc.free(prefix.release(pages))
    held = prefix.match(None, list(range(3, 3 + 2 * PAGE + 1)))  # holds the first two
    assert prefix.evict(3) == 1 and prefix.holds(held[0]) and prefix.holds(held[1])
    alloc.free(prefix.release(held))


def test_a_changed_adapter_takes_its_prefixes_with_it() -> None:
    prefix, alloc = cache()
    tokens = list(range(3, 3 + 2 * PAGE + 1))
    idle = computed(prefix, alloc, "cat", tokens)
    alloc.free(prefix.release(idle))
    busy = prefix.match("cat", tokens)
    base = computed(prefix, alloc, None, tokens)
    prefix.forget_adapter("cat")
    assert prefix.match("cat", tokens) == []
    assert prefix.num_pages == 2 + 2  # cat's pages are still referenced; the base model's stay
    alloc.free(prefix.release(busy))
    assert prefix.idle_pages == 2 and prefix.evict(5) == 2  # cat's, never matched again, leave first-free
    assert prefix.match(None, tokens) == base[:2]


def test_the_same_tokens_on_two_pages_stay_private_on_the_second() -> None:
    prefix, alloc = cache()
    tokens = list(range(3, 3 + 2 * PAGE))
    first = computed(prefix, alloc, None, tokens)
    twin = alloc.allocate(2, KV)  # computed at the same time, before the first was cached
    assert prefix.insert(None, twin, 0, tokens) == 0
    assert prefix.release(twin) == twin and prefix.release(first) == []


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 4 * PAGE + 3)), max_size=40))
def test_reference_counts_under_random_sequences(ops) -> None:
    """Random sequences of matches, computes, releases and evictions over a few shared prompts:
    every cached page is referenced exactly by the sequences holding it, and every page is
    either free, a sequence's own, or cached."""
    prefix, alloc = cache(48)
    prompts = [[3 + (i * 7 + j) % 11 for j in range(5 * PAGE)] for i in range(3)]
    live: list[list[int]] = []
    for op, which, length in ops:
        if op == 0 and prefix.idle_pages + alloc.num_free >= 6:
            tokens = prompts[which % 3][:length]
            pages = prefix.match(None if which < 3 else "cat", tokens)
            want = -(-length // PAGE) - len(pages)
            if not alloc.can_allocate(want):
                prefix.evict(want - alloc.num_free)
            pages += alloc.allocate(want, KV)
            start = len([p for p in pages if prefix.holds(p)])
            prefix.insert(None if which < 3 else "cat", pages, start,
                          tokens[start * PAGE:(length // PAGE) * PAGE])
            live.append(pages)
        elif op == 1 and live:
            alloc.free(prefix.release(live.pop(which % len(live))))
        elif op == 2:
            prefix.evict(which)
        elif op == 3:
            prefix.forget_adapter("cat")
        holders: dict[int, int] = {}
        for pages in live:
            for p in pages:
                holders[p] = holders.get(p, 0) + 1
        for page, block in prefix._by_page.items():
            assert block.refs == holders.get(page, 0)
        assert prefix.idle_pages == sum(1 for b in prefix._by_page.values() if b.refs == 0)
        own = sum(1 for pages in live for p in pages if not prefix.holds(p))
        assert alloc.num_free + own + prefix.num_pages == 48
    for pages in live:
        alloc.free(prefix.release(pages))
    prefix.clear_idle()
    assert alloc.num_free == 48


# ---- inside the scheduler --------------------------------------------------------------------
def build(policy: str, num_pages: int, **cfg) -> object:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_batched_tokens": 32, "max_loras_per_batch": 0,
                                "admit_when_loaded": False, "max_model_len": 256, **cfg})
    geometry = PageGeometry(kv_dim=2, page_tokens=PAGE, max_row_width=0)
    return make_scheduler(policy, config, geometry, PageAllocator(num_pages), ADAPTER_PAGES.__getitem__, (2,))


@pytest.mark.parametrize("policy", ["fcfs", "mlq", "dlora"])
def test_requests_sharing_a_system_prompt_reuse_its_pages_and_get_the_reference_tokens(policy) -> None:
    rng = random.Random(11)
    system = [rng.randrange(3, 60) for _ in range(5 * PAGE + 1)]
    sched = build(policy, 120)
    engine = FakeEngine(sched)
    reqs = []
    for wave in range(3):
        wave_reqs = [request(f"w{wave}-{i}", system + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 9))],
                             rng.randrange(1, 8), rng.choice([None, "cat", "bob"]), seed=i) for i in range(6)]
        for req in wave_reqs:
            engine.add(req)
        engine.run()
        reqs += wave_reqs
    for req in reqs:
        seq = engine.seqs[req.request_id]
        assert (seq.output_ids, seq.finish_reason) == reference(req, 256), req.request_id
    counters = sched.prefix.counters
    # Every adapter's first wave computes the system prompt; later ones find it.
    assert counters.hit_tokens >= 5 * PAGE * 6
    later = [engine.seqs[r.request_id].cached_tokens for r in reqs if not r.request_id.startswith("w0")]
    assert min(later) >= 5 * PAGE
    assert_drained(sched)


def test_cached_prefixes_and_idle_adapters_leave_in_one_order() -> None:
    """A pool that cannot hold everything: the scheduler evicts what was used longest ago,
    be it a cached prefix page or an idle adapter, and still gives the reference tokens."""
    rng = random.Random(5)
    sched = build("fcfs", 24, max_num_seqs=2)
    engine = FakeEngine(sched)
    reqs = []
    for i in range(12):
        req = request(f"r{i}", [rng.randrange(3, 60) for _ in range(3 * PAGE + 1)], 3,
                      rng.choice([None, "ada", "bob", "cat"]), seed=i)
        engine.add(req)
        engine.run()
        reqs.append(req)
    for req in reqs:
        seq = engine.seqs[req.request_id]
        assert (seq.output_ids, seq.finish_reason) == reference(req, 256)
    assert sched.prefix.counters.evicted_pages > 0 and sched.adapters.totals.evictions > 0
    usage = sched.allocator.usage()
    assert usage.by_tag.get(KV, 0) == sched.prefix.num_pages == sched.prefix.idle_pages
    assert usage.by_tag.get(ADAPTER, 0) == sum(ADAPTER_PAGES[n] for n in sched.adapters.resident_names())


def test_prefix_cache_off_keeps_no_page() -> None:
    sched = build("fcfs", 64, prefix_cache=False)
    engine = FakeEngine(sched)
    engine.add(request("a", list(range(3, 3 + 3 * PAGE)), 2))
    engine.run()
    assert sched.prefix is None and sched.allocator.num_free == 64


def test_policies_cost_a_request_by_what_the_cache_does_not_hold() -> None:
    """MLQ sizes a request (and early abort predicts its prefill) by its uncached prompt."""
    rng = random.Random(3)
    system = [rng.randrange(3, 60) for _ in range(6 * PAGE)]
    sched = build("mlq", 120)
    engine = FakeEngine(sched)
    engine.add(request("first", system + [7], 2, "cat"))
    engine.run()
    seq = engine.add(request("second", system + [9, 9, 9], 2, "cat"))
    cold = engine.add(request("cold", system + [9, 9, 9], 2, "bob"))
    assert seq.expected_cached == 6 * PAGE and seq.prefill_len == 3
    assert cold.expected_cached == 0 and cold.prefill_len == 6 * PAGE + 3
    assert sched._features(seq)[0] == 3 and sched._features(cold)[0] == 6 * PAGE + 3
    engine.run()
    assert seq.cached_tokens == 6 * PAGE and cold.cached_tokens == 0


def test_separate_budgets_cap_the_prefix_cache_and_evict_adapters_first() -> None:
    rng = random.Random(9)
    sched = build("fcfs", 40, max_num_seqs=1, prefix_eviction="separate", prefix_cache_share=0.25)
    assert sched.prefix.max_pages == 10 and not sched.prefix.unified
    engine = FakeEngine(sched)
    reqs = [request(f"r{i}", [rng.randrange(3, 60) for _ in range(4 * PAGE + 1)], 2, rng.choice([None, "cat", "bob"]),
                    seed=i) for i in range(10)]
    for req in reqs:
        engine.add(req)
        engine.run()
        assert sched.prefix.num_pages <= 10
        if sched.adapters.totals.evictions == 0:
            assert sched.prefix.counters.evicted_pages == sched.prefix.counters.inserted_pages - sched.prefix.num_pages
    for req in reqs:
        assert (engine.seqs[req.request_id].output_ids, "length") == (reference(req, 256)[0], "length")
    with pytest.raises(ValueError, match="prefix_eviction"):
        SchedulerConfig(prefix_eviction="lru")


@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "mlq", "dlora"])
def test_siblings_wait_for_the_prompt_one_of_them_is_computing(policy, overlapped) -> None:
    """n > 1 (or a burst of one prompt): requests queued together compute their shared prompt
    once; the others wait for its pages instead of computing them again, and pass nobody's
    tokens (a request with another prompt is not held up by them). With a step planned ahead,
    they also wait for pages computed by a launched step whose result has not come yet."""
    rng = random.Random(4)
    prompt = [rng.randrange(3, 60) for _ in range(6 * PAGE + 2)]
    sched = build(policy, 200, max_batched_tokens=16)  # the prompt takes two steps to prefill
    engine = FakeEngine(sched)
    siblings = [engine.add(request(f"s{i}", prompt, 3, "cat", seed=i)) for i in range(3)]
    other = engine.add(request("other", [rng.randrange(3, 60) for _ in range(5)], 3, "cat"))
    engine.run_overlapped() if overlapped else engine.run()
    assert [s.cached_tokens for s in siblings] == [0, 6 * PAGE, 6 * PAGE]
    assert engine.first_step["other"] <= engine.first_step["s1"]
    for seq in siblings + [other]:
        assert (seq.output_ids, seq.finish_reason) == reference(seq.req, 256)
    assert_drained(sched)


def test_a_host_tier_drop_keeps_prefixes_while_a_new_content_or_a_removal_forgets_them() -> None:
    from loraplex.daemon.memory.adapter_residency import AdapterResidency

    for how, kept in (("drop", True), ("invalidate", False), ("forget", False)):
        prefix, alloc = cache()
        residency = AdapterResidency(alloc, "lru", prefix=prefix)
        tokens = list(range(3, 3 + 2 * PAGE + 1))
        alloc.free(prefix.release(computed(prefix, alloc, "cat", tokens)))
        assert residency.acquire("cat", 2)
        residency.release("cat")
        getattr(residency, how)("cat")  # drop: evicted from the host tier, the same weights
        assert (prefix.peek("cat", tokens) == 2 * PAGE) is kept, how
