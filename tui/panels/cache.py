"""Cache panel: the unified pool split into adapter cache / KV / free pages,
hit rate, evictions per second and the resident adapters.

Reads pool, cache{hit_rate, evictions_per_s, adapters}, resident_adapters,
adapter_paths and adapter_counts (registered adapters per tier: gpu, host,
disk, a summary that stays one line at 10,000 adapters); falls back to the
admin adapter list for rank/pages/refs and to History for evictions/s when the
daemon does not report them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, dig, fmt_count, fmt_pct, fmt_rate, num, rows, stacked_bar
from loraplex.tui.panels.base import PanelSpec, compact_table, kv, note
from loraplex.tui.view import View

COLUMNS = (("adapter", "left"), ("rank", "right"), ("pages", "right"), ("refs", "right"), ("hits", "right"),
           ("score", "right"))
CACHE_STYLE, KV_STYLE, FREE_STYLE = "magenta", "cyan", "bright_black"
MISS_PATHS = ("loaded", "cpu_assisted")


def hit_rate(stats: Mapping[str, Any]) -> float | None:
    """cache.hit_rate, else the share of adapter requests served from the cache."""
    reported = num(dig(stats, "cache", "hit_rate"))
    if reported is not None:
        return reported
    paths = stats.get("adapter_paths")
    if not isinstance(paths, Mapping):
        return None
    hits = num(paths.get("cached")) or 0.0
    total = hits + sum(num(paths.get(p)) or 0.0 for p in MISS_PATHS)
    return hits / total if total > 0 else None


def pool_bar(stats: Mapping[str, Any], width: int) -> Text:
    """The unified pool as one bar: adapter cache | KV | free pages, labelled."""
    total = num(dig(stats, "pool", "total"))
    if not total:
        return note("pool n/a")
    cache, kv_pages, free = (num(dig(stats, "pool", k)) or 0.0 for k in ("adapter", "kv", "free"))
    return stacked_bar([(cache, f"cache {fmt_count(cache)}", "█", CACHE_STYLE),
                        (kv_pages, f"kv {fmt_count(kv_pages)}", "█", KV_STYLE),
                        (free, f"free {fmt_count(free)}", "░", FREE_STYLE)],
                       cache + kv_pages + free or total, max(4, width))


def adapter_rows(view: View) -> list[list[str]]:
    """cache.adapters when reported, else resident adapters from the admin list or names only."""
    cached = rows(dig(view.stats, "cache", "adapters"))
    if cached:
        return [[str(a.get("name", "?")), fmt_count(a.get("rank")), fmt_count(a.get("pages")),
                 fmt_count(a.get("refs")), fmt_count(a.get("hits")),
                 MISSING if num(a.get("score")) is None else f"{num(a.get('score')):.2f}"] for a in cached]
    resident = [str(n) for n in view.stats.get("resident_adapters") or () if isinstance(n, str)]
    known = {str(a.get("name")): a for a in view.adapters or ()}
    return [[name, fmt_count(dig(known, name, "rank")), fmt_count(dig(known, name, "pages")),
             fmt_count(dig(known, name, "refs")), MISSING, MISSING] for name in resident]


def tier_line(stats: Mapping[str, Any]) -> Text | None:
    """Where the registered adapters are (gpu / host / disk, summing to all of them) and how many are
    in error, when the daemon reports adapter_counts; short enough for a narrow panel."""
    counts = stats.get("adapter_counts")
    if not isinstance(counts, Mapping):
        return None
    tiers = counts.get("tiers") if isinstance(counts.get("tiers"), Mapping) else {}
    pairs = [(t, fmt_count(tiers.get(t))) for t in ("gpu", "host", "disk")]
    if num(counts.get("error")):
        pairs.append(("err", fmt_count(counts.get("error"))))
    return kv(*pairs)


def render_cache(view: View, width: int, height: int) -> RenderableType:
    s = view.stats
    evictions = num(dig(s, "cache", "evictions_per_s"))
    if evictions is None:
        evictions = view.history.rate("adapter_evictions")
    head = [pool_bar(s, width),
            kv(("hit", fmt_pct(hit_rate(s))), ("evict", fmt_rate(evictions)),
               ("pages", fmt_count(dig(s, "pool", "total"))))]
    tiers = tier_line(s)
    if tiers is not None:
        head.append(tiers)
    for text in head:
        text.no_wrap, text.overflow = True, "ellipsis"
    room = height - len(head)
    if room <= 0:
        return Group(*head[:max(1, height)])
    body = adapter_rows(view)
    if not body:
        return Group(*head, note("no resident adapters"))
    return Group(*head, compact_table(COLUMNS, body, room))


PANEL = PanelSpec("cache", "Cache", render_cache)
