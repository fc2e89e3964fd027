"""Formatting shared by the panels: numbers, durations, percentages, sparklines, bars.

Pure functions over plain values. A value that is missing or not a finite
number (a key the daemon does not send yet) always renders as MISSING, never
as 0, so an operator can tell "zero" from "not reported".
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.text import Text

MISSING = "—"
SPARK_CHARS = "▁▂▃▄▅▆▇█"


def dig(data: Any, *keys: str | int) -> Any:
    """data[k0][k1]... or None as soon as a level is missing or of the wrong kind."""
    for key in keys:
        if isinstance(data, Mapping):
            data = data.get(key)
        elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and isinstance(key, int):
            data = data[key] if -len(data) <= key < len(data) else None
        else:
            return None
    return data


def num(value: Any) -> float | None:
    """`value` as a float if it is a finite int/float (bools excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def latency_ms(stats: Any, key: str, q: str) -> float | None:
    """latency[key][q] of a snapshot; None over an empty window (the daemon sends 0.0 with n == 0)."""
    if num(dig(stats, "latency", key, "n")) == 0:
        return None
    return num(dig(stats, "latency", key, q))


def rows(value: Any) -> list[Mapping[str, Any]]:
    """The mapping entries of a list-valued key; [] when absent or malformed."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return []
    return [entry for entry in value if isinstance(entry, Mapping)]


def fmt_count(value: Any) -> str:
    """1234 -> '1234', 12345 -> '12.3k', 4.5e6 -> '4.5M'."""
    v = num(value)
    if v is None:
        return MISSING
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(v) >= limit:
            scaled = v / (limit if suffix != "k" else 1e3)
            return f"{scaled:.1f}{suffix}"
    return f"{v:.0f}" if v == int(v) else f"{v:.1f}"


def fmt_id(value: Any) -> str:
    """An identifier number (pid, index) in full: never abbreviated."""
    v = num(value)
    return MISSING if v is None else f"{v:.0f}"


def fmt_ms(value: Any) -> str:
    """Milliseconds, switching to seconds from 10 s up."""
    v = num(value)
    if v is None:
        return MISSING
    if v >= 10_000:
        return f"{v / 1000:.1f}s"
    if v >= 100:
        return f"{v:.0f}ms"
    return f"{v:.1f}ms"


def fmt_rate(value: Any, unit: str = "/s") -> str:
    """A per-second rate with its unit ('12.5/s', '1.2k tok/s'); the unit stays when the value is missing."""
    v = num(value)
    if v is None:
        return f"{MISSING}{unit}"
    return f"{fmt_count(v) if v >= 100 else f'{v:.1f}'}{unit}"


def fmt_pct(value: Any, *, fraction: bool = True, digits: int = 1) -> str:
    """A percentage; `fraction` means 0..1 (else already 0..100)."""
    v = num(value)
    if v is None:
        return MISSING
    return f"{v * 100 if fraction else v:.{digits}f}%"


def fmt_duration(value: Any) -> str:
    """Seconds as '42s', '3m04s', '2h05m', '3d04h'."""
    v = num(value)
    if v is None or v < 0:
        return MISSING
    s = int(v)
    if s < 60:
        return f"{v:.0f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_text(value: Any, default: str = MISSING) -> str:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return "yes" if value else "no"
    if num(value) is not None:
        return fmt_count(value)
    return str(value)


def sparkline(values: Sequence[float], width: int, *, top: float | None = None) -> str:
    """The last values as `width` block characters (bucket means when there are
    more values than cells; left-padded with spaces when fewer). `top` fixes
    the full-scale value (e.g. the link bandwidth), else the series maximum."""
    if width <= 0:
        return ""
    if not values:
        return " " * width
    if len(values) > width:
        step = len(values) / width
        values = [
            sum(chunk) / len(chunk)
            for chunk in (values[int(i * step):max(int(i * step) + 1, int((i + 1) * step))] for i in range(width))
        ]
    scale = top if top is not None and top > 0 else max(values)
    if scale <= 0:
        cells = SPARK_CHARS[0] * len(values)
    else:
        last = len(SPARK_CHARS) - 1
        cells = "".join(SPARK_CHARS[max(0, min(last, round(v / scale * last)))] for v in values)
    return cells.rjust(width)


def stacked_bar(parts: Sequence[tuple[float, str, str, str]], total: float, width: int) -> Text:
    """One line of `width` cells split proportionally between parts
    (count, label, fill character, style); each segment starts with its label
    where it fits, so the bar is its own legend, and the rounding error goes
    to the last part."""
    bar = Text()
    if width <= 0 or total <= 0:
        return bar
    used = 0
    for i, (count, label, char, style) in enumerate(parts):
        cells = width - used if i == len(parts) - 1 else round(max(0.0, count) / total * width)
        cells = max(0, min(cells, width - used))
        shown = next((t for t in (label, label.split(" ")[0]) if len(t) < cells), "")
        bar.append(shown, style=f"bold reverse {style}")
        bar.append(char * (cells - len(shown)), style=style)
        used += cells
    return bar
