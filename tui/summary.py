"""`loraplex stats` without --json: the stats document (daemon/stats.py and
ServingCore.snapshot) as a dozen labelled lines an operator reads at a glance.

Pure function of the snapshot, with the console's formatting (tui/format.py): a
key the daemon does not send shows as '—', never as 0. No I/O, no Textual.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.tui.format import (
    MISSING,
    dig,
    fmt_count,
    fmt_duration,
    fmt_ms,
    fmt_pct,
    fmt_text,
    latency_ms,
    num,
    rows,
)

SEP = " · "
LABEL_WIDTH = 9


def _line(label: str, *parts: str) -> str:
    return f"{label:<{LABEL_WIDTH}} " + SEP.join(p for p in parts if p)


def _p50_p99(stats: Mapping[str, Any], label: str, key: str) -> str:
    return f"{label} p50 {fmt_ms(latency_ms(stats, key, 'p50'))} p99 {fmt_ms(latency_ms(stats, key, 'p99'))}"


def _flags(stats: Mapping[str, Any]) -> list[str]:
    return [name for name in ("paused", "draining") if stats.get(name) is True]


def _engines(stats: Mapping[str, Any]) -> str:
    engines = rows(stats.get("engines"))
    up = sum(1 for e in engines if e.get("alive") is True)
    restarts = num(stats.get("engine_restarts")) or 0
    tp = max((num(e.get("tensor_parallel_size")) or 1 for e in engines), default=1)
    return _line("engines", f"{up}/{len(engines)} up" if engines else MISSING,
                 f"tensor_parallel_size {tp:.0f}" if tp > 1 else "",
                 f"{fmt_count(stats.get('steps'))} steps (p50 {fmt_ms(latency_ms(stats, 'step_ms', 'p50'))})",
                 f"mean batch {fmt_text(stats.get('mean_batch_rows'))} rows",
                 f"{fmt_count(stats.get('tokens'))} tokens",
                 f"{restarts:.0f} restart{'s' if restarts != 1 else ''}" if restarts else "")


def _pool(stats: Mapping[str, Any]) -> str:
    pool = stats.get("pool")
    total, free = num(dig(pool, "total")), num(dig(pool, "free"))
    if not total or free is None:
        return _line("pool", MISSING)
    used = total - free
    return _line("pool", f"{used:.0f}/{total:.0f} pages used ({fmt_pct(used / total)})",
                 f"kv {fmt_count(dig(pool, 'kv'))}",
                 (f"cached prefixes {fmt_count(dig(pool, 'prefix_cache'))}"
                  if dig(pool, "prefix_cache") is not None else ""),
                 f"adapters {fmt_count(dig(pool, 'adapter'))}")


def _prefix(stats: Mapping[str, Any]) -> str | None:
    prefix = stats.get("prefix_cache")
    if not isinstance(prefix, Mapping):
        return None  # off
    return _line("prefix", f"{fmt_count(prefix.get('hit_tokens'))} of {fmt_count(prefix.get('query_tokens'))} "
                 f"prompt tokens cached (hit {fmt_pct(prefix.get('hit_rate'))})",
                 f"{fmt_count(prefix.get('pages'))} pages", f"{fmt_count(prefix.get('evicted_pages'))} evicted")


def _cache(stats: Mapping[str, Any]) -> str:
    cache = stats.get("cache") if isinstance(stats.get("cache"), Mapping) else {}
    names = stats.get("resident_adapters")
    resident = cache.get("resident", len(names) if isinstance(names, list) else None)
    return _line("gpu cache", f"{fmt_count(resident)} adapters resident", f"hit {fmt_pct(cache.get('hit_rate'))}",
                 f"{fmt_count(stats.get('adapter_placements'))} placed",
                 f"{fmt_count(stats.get('adapter_evictions'))} evicted")


def _host(stats: Mapping[str, Any]) -> str | None:
    host = stats.get("host_tier")
    if not isinstance(host, Mapping):
        return None
    used, capacity = num(host.get("used_bytes")), num(host.get("capacity_bytes"))
    share = f"{used / 2**20:.0f}/{capacity / 2**20:.0f} MiB" if used is not None and capacity else MISSING
    return _line("host tier", f"{fmt_count(host.get('adapters'))} adapters in {share}",
                 f"{fmt_count(host.get('loads'))} loads", f"{fmt_count(host.get('evictions'))} evicted",
                 "" if host.get("alive") is not False else "cache manager down")


def _pcie(stats: Mapping[str, Any]) -> str:
    pcie = stats.get("pcie")
    h2d, d2h = num(dig(pcie, "h2d_mb_s")), num(dig(pcie, "d2h_mb_s"))
    return _line("pcie", f"h2d {MISSING if h2d is None else f'{h2d:.1f}'} MB/s",
                 f"d2h {MISSING if d2h is None else f'{d2h:.1f}'} MB/s",
                 "no GPU link" if isinstance(pcie, Mapping) and num(pcie.get("link_mb_s")) is None
                 else f"{fmt_pct(dig(pcie, 'utilisation_pct'), fraction=False)} of the link")


def _cpu(stats: Mapping[str, Any]) -> str | None:
    workers = rows(stats.get("workers"))
    assist = stats.get("cpu_assist")
    if not workers and not isinstance(assist, Mapping):
        return None
    busy = [b for b in (num(w.get("busy_pct")) for w in workers) if b is not None]
    alive = sum(1 for w in workers if w.get("alive") is not False)
    return _line("cpu lora", f"{alive}/{len(workers)} workers up",
                 f"busy {fmt_pct(sum(busy) / len(busy), fraction=False, digits=0)}" if busy else "",
                 f"{fmt_count(dig(assist, 'jobs'))} jobs", f"{fmt_count(dig(assist, 'failures'))} failed")


def summary_lines(stats: Mapping[str, Any]) -> list[str]:
    """The summary `loraplex stats` prints; the last line points to the full document."""
    cache_policy = stats.get("cache_policy") or dig(stats, "cache", "policy")
    lines = [
        _line("daemon", f"up {fmt_duration(stats.get('uptime_s'))}", f"scheduler {fmt_text(stats.get('scheduler'))}",
              f"cache {fmt_text(cache_policy)}", f"router {fmt_text(stats.get('router'))}",
              f"loads {fmt_text(stats.get('load_mode'))}", *_flags(stats)),
        _line("requests", f"{fmt_count(stats.get('running'))} running", f"{fmt_count(stats.get('waiting'))} waiting",
              f"{fmt_count(stats.get('completed'))} done", f"{fmt_count(stats.get('cancelled'))} cancelled",
              f"{fmt_count(stats.get('errors'))} errors", f"{fmt_count(stats.get('preemptions'))} preempted"),
        _line("latency", _p50_p99(stats, "TTFT", "ttft_ms"), _p50_p99(stats, "TPT", "tpt_ms"),
              _p50_p99(stats, "E2E", "e2e_ms")),
        _engines(stats),
        _pool(stats),
        _cache(stats),
        _prefix(stats),
        _host(stats),
        _pcie(stats),
        _cpu(stats),
    ]
    return [line for line in lines if line is not None] + ["(the full document: loraplex stats --json)"]
