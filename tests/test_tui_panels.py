"""Console panels as pure functions: snapshot dict -> text, with every key
present, with the keys today's daemon lacks, and with malformed values.
Also the History arithmetic (rates, restarts) and the formatting helpers."""
from __future__ import annotations

import pytest

from loraplex.tui.format import MISSING, dig, fmt_count, fmt_duration, fmt_ms, sparkline, stacked_bar
from loraplex.tui.history import History, flatten
from loraplex.tui.panels import HEALTH, PANELS, plain_text
from loraplex.tui.panels.cache import hit_rate
from loraplex.tui.summary import summary_lines
from loraplex.tui.view import Link, View
from tests.test_tui_support import base_snapshot, full_snapshot

ALL = (HEALTH, *PANELS)
BY_ID = {spec.id: spec for spec in ALL}


def history_of(*snapshots: dict) -> History:
    history = History()
    for i, snapshot in enumerate(snapshots):
        history.add(snapshot, float(i))
    return history


def render(panel: str, view: View, width: int = 60, height: int = 12) -> str:
    return plain_text(BY_ID[panel].render(view, width, height), width)


def live(stats: dict, **kw) -> View:
    return View(stats=stats, history=kw.pop("history", history_of(stats)), link=Link.LIVE, age_s=0.1, **kw)


def test_panel_titles_are_the_ones_operators_look_for():
    assert [s.title for s in ALL] == ["Daemon health", "Requests", "Queues", "Cache", "PCIe", "Workers", "Engines",
                                      "In flight"]


def test_requests_panel_shows_counts_latency_slo_and_errors():
    text = render("requests", live(full_snapshot()))
    for needle in ("run 7", "wait 13", "done 480", "err 2", "TTFT", "12.5ms", "88.2ms", "TPT", "4.2ms", "9.5ms",
                   "SLO 97.5%", "engine_failed engine 0 died", "overloaded queue full"):
        assert needle in text, needle
    assert text.index("engine_failed") < text.index("overloaded")  # newest first


def test_queues_panel_lists_lanes():
    text = render("queues", live(full_snapshot()))
    for needle in ("short", "900/1000", "35.0ms", "0.25", "medium", "300/2000", "120ms", "long", "2500ms"):
        assert needle in text, needle


def test_cache_panel_bar_hit_rate_evictions_and_adapters():
    text = render("cache", live(full_snapshot()), width=70)
    for needle in ("cache 120", "kv 300", "free 180", "hit 87.5%", "evict 0.5/s", "pages 600",
                   "qv-r8", "310", "0.91", "all-r32", "0.42", "mlp-r64"):
        assert needle in text, needle


def test_cache_panel_summarises_registered_adapters_by_tier():
    counts = {"total": 10_000, "registered": 9_000, "ready": 998, "error": 2,
              "tiers": {"gpu": 12, "host": 988, "disk": 9_000}}
    text = render("cache", live({**full_snapshot(), "adapter_counts": counts}), width=70)
    assert "gpu 12  host 988  disk 9000  err 2" in text
    healthy = render("cache", live({**full_snapshot(), "adapter_counts": {**counts, "error": 0}}), width=70)
    assert "disk 9000" in healthy and "err" not in healthy
    assert "disk" not in render("cache", live(full_snapshot()), width=70)  # an older daemon: no line


def test_pcie_panel_rates_link_share_and_purposes():
    snaps = [full_snapshot(uptime=100.0 + i) for i in range(5)]
    for i, s in enumerate(snaps):
        s["pcie"]["h2d_mb_s"] = 100.0 * (i + 1)
    view = live(snaps[-1], history=history_of(*snaps))
    text = render("pcie", view, width=70)
    assert "500 MB/s" in text and "2.0%" in text  # 500 of 25000 MB/s
    assert "64.0 MB/s" in text and "adapter 700" in text and "activations 112" in text
    h2d = next(line for line in text.splitlines() if line.startswith("H2D"))
    assert "▂▄▅▇█" in h2d  # the sparkline rises over the window, zero-based


def test_workers_panel_per_worker_rows():
    text = render("workers", live(full_snapshot()))
    assert "workers 4" in text and "busy 30%" in text and "tok/s 1000" in text
    for pid in ("5000", "5001", "5002", "5003"):
        assert pid in text
    assert "60%" in text


def test_workers_tokens_per_s_derived_from_counters():
    snaps = []
    for i in range(3):
        s = base_snapshot(uptime=10.0 + i)
        s["workers"] = [{"index": 0, "pid": 7, "busy_pct": 50.0, "tokens": 100 * i, "restarts": 0}]
        snaps.append(s)
    text = render("workers", live(snaps[-1], history=history_of(*snaps)))
    assert "100" in text.splitlines()[2]  # 100 tokens per second of uptime


def test_engines_panel_from_engines_list_and_from_a_daemon_without_one():
    text = render("engines", live(full_snapshot()))
    assert "6.5ms" in text and "7.5" in text and "70.0%" in text and "up" in text
    row = next(line for line in render("engines", live(base_snapshot())).splitlines() if line.startswith("0 "))
    assert row.split() == ["0", "up", "6.8ms", "7.0", "70.0%"]  # the daemon's live step and batch
    older = {k: v for k, v in base_snapshot().items() if k != "engines"}
    text = render("engines", live(older))  # no `engines`: one row from engine/latency/pool
    assert "6.5ms" in text and "7.5" in text and "70.0%" in text


def test_workers_panel_reads_the_cpu_assist_pool_and_says_why_it_is_empty():
    s = base_snapshot()
    s["load_mode"], s["workers"] = "cpu_assist", []
    s["cpu_assist"] = {"jobs": 3, "workers": [{"index": 0, "pid": 7001, "alive": True, "ready": True, "starts": 1},
                                              {"index": 1, "pid": 7002, "alive": False, "ready": False, "starts": 3}]}
    text = render("workers", live(s))
    assert "workers 2" in text and "n/a" not in text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [r[:3] for r in rows] == [["0", "7001", "up"], ["1", "7002", "down"]] and rows[1][-1] == "2"
    assert "no CPU LoRA workers (on_demand loads)" in render("workers", live(base_snapshot()))
    assert "CPU LoRA pool n/a" in render("workers", live({"uptime_s": 1.0}))  # a daemon that says nothing


def test_in_flight_panel_lists_requests_oldest_first_with_moving_ages():
    view = live(base_snapshot())
    text = render("inflight", view, width=70)
    lines = text.splitlines()
    assert lines[0].split() == ["request", "adapter", "state", "tokens", "age"]
    assert lines[1].split() == ["chat-7f3a", "qv-r8", "decode", "212", "10s"]  # 9.5 s at the snapshot + 0.1
    assert lines[2].split()[:3] == ["lpx-0c41d2e9b6a8", "<base>", "prefill"]
    assert "+17 more in flight not listed" in text
    later = View(stats=view.stats, history=view.history, link=Link.LIVE, age_s=60.0)
    assert "1m09s" in render("inflight", later, width=70)
    assert "no requests in flight" in render("inflight", live({**base_snapshot(), "in_flight": [],
                                                                "in_flight_total": 0}))
    older = {k: v for k, v in base_snapshot().items() if k != "in_flight"}
    assert "request list n/a" in render("inflight", live(older))


def test_health_line_live_disconnected_and_connecting():
    text = render("health", live(full_snapshot()), width=100)
    assert "LIVE" in text and "up 1h02m" in text and "pid 42421" in text and "cuda:0" in text
    assert "restarts 1" in text
    gone = View(stats=full_snapshot(), link=Link.DISCONNECTED, reason="no daemon: /x/stats.sock does not exist",
                age_s=75.0)
    text = render("health", gone, width=120)
    assert "DISCONNECTED" in text and "/x/stats.sock" in text and "1m15s ago" in text
    assert "CONNECTING" in render("health", View(target="/run/lpx"))
    assert "ranks" not in render("health", live(full_snapshot()), width=100)  # one device: no TP size shown


def test_a_tensor_parallel_engine_shows_its_size_in_top_and_stats():
    snapshot = full_snapshot()
    tp = {**snapshot, "engine": {**snapshot["engine"], "tensor_parallel_size": 2},
          "engines": [{**e, "tensor_parallel_size": 2} for e in snapshot["engines"]]}
    assert "cuda:0 ×2 ranks" in render("health", live(tp), width=120)
    assert "tensor_parallel_size 2" in summary_lines(tp)[3]
    assert "tensor_parallel_size" not in summary_lines(snapshot)[3]


def test_draining_is_flagged():
    s = base_snapshot()
    s["draining"] = True
    assert "DRAINING" in render("health", live(s), width=100)


def test_paused_is_flagged():
    s = base_snapshot()
    assert "PAUSED" not in render("health", live(s), width=100)
    s["paused"] = True
    assert "PAUSED" in render("health", live(s), width=100)


def test_todays_daemon_renders_with_placeholders_not_zeros():
    view = live(base_snapshot())
    assert "SLO —" in render("requests", view)
    assert "per-lane stats n/a" in render("queues", view) and "13" in render("queues", view)
    pcie = render("pcie", view)
    assert "PCIe counters n/a" in pcie and "0 MB/s" not in pcie
    assert "no CPU LoRA workers" in render("workers", view)
    cache = render("cache", view, width=70)
    assert "hit 87.5%" in cache  # 350 cached of 400 adapter requests (base excluded)
    assert "qv-r8" in cache and "all-r32" in cache


def test_cache_rows_use_the_admin_adapter_list_when_cache_stats_are_missing():
    adapters = ({"name": "qv-r8", "rank": 8, "pages": 16, "refs": 2},)
    text = render("cache", live(base_snapshot(), adapters=adapters), width=70)
    row = next(line for line in text.splitlines() if line.startswith("qv-r8"))
    assert row.split()[:4] == ["qv-r8", "8", "16", "2"]


@pytest.mark.parametrize("stats", [
    {},
    {"queues": "nope", "cache": 3, "pcie": [1, 2], "workers": {"a": 1}, "engines": None, "latency": "x",
     "pool": {"total": "600"}, "recent_errors": [1, "x", {"code": "c"}], "engine": [], "uptime_s": float("nan")},
    {"queues": [{"name": None, "depth": "x"}], "workers": [{}], "engines": [{}], "cache": {"adapters": [{}]},
     "in_flight": [{}, {"id": None, "age_s": "old", "tokens": -1}], "in_flight_total": "many"},
    {"in_flight": "x", "cpu_assist": {"workers": [{"starts": "x"}]}, "host_tier": {"used_bytes": "x"}, "pool": 7},
])
@pytest.mark.parametrize("size", [(80, 24), (1, 1), (20, 3), (200, 60)])
def test_every_panel_survives_missing_and_malformed_values(stats, size):
    view = View(stats=stats, history=history_of(stats), link=Link.LIVE)
    for spec in ALL:
        plain_text(spec.render(view, *size), size[0])
    assert summary_lines(stats)[-1] == "(the full document: loraplex stats --json)"


def test_stats_summary_is_a_few_labelled_lines_of_the_document():
    lines = summary_lines(full_snapshot())
    assert len(lines) == 9, lines  # no host tier in this snapshot
    assert lines[0] == "daemon    up 1h02m · scheduler mlq · cache lru · router most_idle · loads cpu_assist"
    assert lines[1].startswith("requests  7 running · 13 waiting · 480 done · 3 cancelled · 2 errors")
    assert "TTFT p50 12.5ms p99 88.2ms" in lines[2] and "E2E p50 420ms p99 1800ms" in lines[2]
    assert lines[3].startswith("engines   1/1 up · 9000 steps (p50 6.5ms)") and "1 restart" in lines[3]
    assert lines[4] == "pool      420/600 pages used (70.0%) · kv 300 · adapters 120"
    with_prefix = summary_lines({**full_snapshot(), "pool": {"total": 600, "free": 180, "kv": 280, "prefix_cache": 20,
                                                            "adapter": 120},
                                 "prefix_cache": {"query_tokens": 4000, "hit_tokens": 1000, "hit_rate": 0.25,
                                                  "pages": 60, "evicted_pages": 7}})
    assert with_prefix[4] == "pool      420/600 pages used (70.0%) · kv 280 · cached prefixes 20 · adapters 120"
    assert with_prefix[6] == "prefix    1000 of 4000 prompt tokens cached (hit 25.0%) · 60 pages · 7 evicted"
    assert "hit 87.5%" in lines[5] and "3 adapters resident" in lines[5]
    assert lines[6].startswith("pcie      h2d 812.0 MB/s · d2h 64.0 MB/s")
    assert lines[7].startswith("cpu lora  4/4 workers up · busy 30%")
    paused = summary_lines({**full_snapshot(), "paused": True, "draining": True})[0]
    assert paused.endswith("· paused · draining")


def test_small_boxes_cut_tables_and_say_how_many_rows_are_hidden():
    s = full_snapshot()
    s["queues"] = [{"name": f"q{i}", "depth": i} for i in range(10)]
    text = render("queues", live(s), height=4)
    assert len(text.splitlines()) == 4 and "+8 more" in text


def test_history_rates_and_restart():
    history = History(rate_window_s=2.0)
    for t in range(6):
        history.add({"uptime_s": float(t), "tokens": 50 * t}, received=1000.0 + t)
    assert history.rate("tokens") == pytest.approx(50.0)
    assert history.rate_series("tokens") == [50.0] * 5
    assert history.rate("missing") is None
    history.add({"uptime_s": 1.0, "tokens": 10}, received=1010.0)  # the daemon restarted
    assert len(history) == 1 and history.rate("tokens") is None


def test_history_window_drops_old_samples_and_uses_receive_time_without_uptime():
    history = History(window_s=10.0)
    for t in range(30):
        history.add({"tokens": t}, received=float(t))
    assert history.span_s == pytest.approx(10.0)
    assert history.rate("tokens") == pytest.approx(1.0)


def test_flatten_keys():
    flat = flatten(full_snapshot())
    assert flat["latency.ttft_ms.p50"] == 12.5
    assert flat["workers.3.tokens_per_s"] == 400.0
    assert flat["queues.short.depth"] == 5
    assert flat["pcie.h2d_mb_s"] == 812.0
    assert not any(k.startswith(("requests_by_adapter", "cache.adapters", "recent_errors")) for k in flat)


def test_formatting_helpers():
    assert fmt_count(None) == MISSING and fmt_count(True) == MISSING and fmt_count(float("inf")) == MISSING
    assert fmt_count(1234) == "1234" and fmt_count(12345) == "12.3k" and fmt_count(4.5e6) == "4.5M"
    assert fmt_ms(1.234) == "1.2ms" and fmt_ms(250.4) == "250ms" and fmt_ms(12_000) == "12.0s"
    assert fmt_duration(42) == "42s" and fmt_duration(184) == "3m04s" and fmt_duration(7500) == "2h05m"
    assert dig({"a": [{"b": 1}]}, "a", 0, "b") == 1 and dig({"a": 1}, "a", "b") is None
    assert sparkline([], 4) == "    " and sparkline([0, 0], 2) == "▁▁"
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert len(sparkline(list(range(1000)), 10)) == 10
    bar = stacked_bar([(1, "a", "#", ""), (1, "b", "=", ""), (2, "free", ".", "")], 4, 20)
    assert bar.plain == "a####b====free......"
    assert hit_rate({"adapter_paths": {"base": 5}}) is None


def test_empty_latency_windows_show_placeholders_not_zero():
    s = base_snapshot()
    for window in s["latency"].values():
        window.update(p50=0.0, p99=0.0, n=0)
    s["mean_batch_rows"] = 0.0
    view = live(s)
    assert "0.0ms" not in render("requests", view) and "TTFT p50       —" in render("requests", view)
    engines = render("engines", view)
    assert "0.0ms" not in engines and "up" in engines


def test_action_parsing():
    from loraplex.tui.actions import ACTIONS, parse

    assert parse(ACTIONS["drain"], {"timeout_s": "12.5"}) == {"timeout_s": 12.5}
    assert parse(ACTIONS["add"], {"name": "sql", "path": "/a/b/../sql"}) == {"name": "sql", "path": "/a/sql"}
    assert parse(ACTIONS["policy"], {"kind": "router", "name": "dlora"}) == {"kind": "router", "name": "dlora"}
    assert parse(ACTIONS["policy"], {"kind": "cache", "name": "lru"}) == {"kind": "cache", "name": "lru"}
    for action, raw, message in [
        ("drain", {"timeout_s": "0"}, "Timeout"), ("drain", {"timeout_s": "nan"}, "Timeout"),
        ("pin", {"name": ".."}, "Adapter"), ("pin", {"name": " "}, "required"),
        ("policy", {"kind": "engine", "name": "x"}, "one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(ACTIONS[action], raw)
