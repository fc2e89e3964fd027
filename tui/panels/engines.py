"""Engines panel: per engine replica step time, batch size and pool use, plus
a tokens/s sparkline.

Reads `engines` (list of {index, step_ms, batch_rows, pool_used_pct}); a
daemon with one engine and no such list is shown from `engine`,
latency.step_ms, mean_batch_rows and pool.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from loraplex.tui.format import MISSING, dig, fmt_id, fmt_ms, fmt_pct, fmt_rate, latency_ms, num, rows, sparkline
from loraplex.tui.panels.base import BAD, DIM, GOOD, PanelSpec, compact_table
from loraplex.tui.view import View

COLUMNS = (("#", "right"), ("state", "left"), ("step", "right"), ("batch", "right"), ("pool", "right"))


def pool_used_pct(pool: Any) -> float | None:
    total, free = num(dig(pool, "total")), num(dig(pool, "free"))
    if not total or free is None:
        return None
    return (total - free) / total * 100.0


def single_engine(stats: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The `engines` list a one-engine daemon implies."""
    engine = stats.get("engine")
    if not isinstance(engine, Mapping):
        return []
    return [{"index": engine.get("index", 0), "alive": engine.get("alive"),
             "step_ms": latency_ms(stats, "step_ms", "p50"),
             "batch_rows": stats.get("mean_batch_rows") if latency_ms(stats, "step_ms", "p50") is not None else None,
             "pool_used_pct": pool_used_pct(stats.get("pool"))}]


def state_cell(alive: Any) -> Text:
    if alive is None:
        return Text(MISSING)
    return Text("up", style=GOOD) if alive else Text("down", style=BAD)


def batch_cell(value: Any) -> str:
    v = num(value)
    return MISSING if v is None else f"{v:.1f}"


def render_engines(view: View, width: int, height: int) -> RenderableType:
    engines = rows(view.stats.get("engines")) or single_engine(view.stats)
    tokens = view.history.rate_series("tokens")
    spark = Text("tok/s ", style=DIM)
    value = f" {fmt_rate(view.history.rate('tokens'), '')}"
    spark.append(sparkline(tokens, max(0, width - len(spark) - len(value))), style="green").append(value)
    spark.no_wrap, spark.overflow = True, "ellipsis"
    if not engines:
        return Group(spark, Text("engines n/a", style=DIM))
    body = [[fmt_id(e.get("index")), state_cell(e.get("alive")), fmt_ms(e.get("step_ms")),
             batch_cell(e.get("batch_rows")), fmt_pct(e.get("pool_used_pct"), fraction=False)]
            for e in engines]
    if height <= 2:
        return compact_table(COLUMNS, body, height)
    return Group(compact_table(COLUMNS, body, height - 1), spark)


PANEL = PanelSpec("engines", "Engines", render_engines)
