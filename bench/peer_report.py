"""bench/peers.py's report: one result per system and workload in the shape the issue asks for
(`{"system", "adapters", "popularity", "ranks", "rate", "base_only", "ok", "reason",
"output_tokens_per_s", "ttft_p50_ms", ..., "peak_rss_mb", "wrong_outputs", "checked_outputs",
"settings"}`), each system's texts checked against PEFT's, its slowdown over its own base-model
run, the ratios of every system to loraplex per sweep point, and a markdown table.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REFERENCE = "peft"  # the outputs every other system's are checked against


@dataclass(frozen=True, slots=True)
class Output:
    """One request's output as a system returned it: its text and, where the server named them,
    its token ids (then the check compares tokens, and no detokenizer seam can hide a wrong one)."""

    text: str
    token_ids: list[int] | None = None


def result_entry(system: str, point: Any, rate: float, run: dict[str, Any]) -> dict[str, Any]:
    """One system on one workload (`point` None: the base model alone). `run` is what the system's
    runner gave: its summary, texts, settings, peak memory, cold probe; or its error."""
    entry: dict[str, Any] = {
        "system": system, "adapters": point.adapters if point else 0,
        "popularity": point.popularity if point else None, "ranks": point.ranks if point else None,
        "point": point.key if point else "base", "rate": rate, "base_only": point is None,
        "ok": "error" not in run, "reason": run.get("error", "")}
    summary = run.get("summary") or {}
    entry.update({
        "output_tokens_per_s": summary.get("output_tok_s"), "ttft_p50_ms": summary.get("ttft_ms_p50"),
        "ttft_p99_ms": summary.get("ttft_ms_p99"), "tpot_p50_ms": summary.get("tpot_ms_p50"),
        "tpot_p99_ms": summary.get("tpot_ms_p99"), "finished": summary.get("finished", 0),
        "failed": summary.get("failed", 0), "errors": summary.get("errors", []),
        "peak_rss_mb": run.get("peak_rss_mb"), "wrong_outputs": None, "checked_outputs": None,
        "first_wrong": [], "started_s": run.get("started_s"), "warm_up_s": run.get("warm_up_s"),
        "settings": run.get("settings", {})})
    for extra in ("cold", "steps"):  # the cold-adapter probe; the server's own step report
        if run.get(extra) is not None:
            entry[extra] = run[extra]
    if entry["ok"] and summary.get("finished", 0) == 0:
        entry.update(ok=False, reason=f"no request finished: {summary.get('errors')}")
    return entry


@dataclass
class Reference:
    """PEFT's greedy tokens per request and each token's margin over the runner-up logit, and the
    tokenizer's decode (special tokens skipped, as servers stream them).

    Where another system's text first leaves PEFT's tells what the difference can be:
    - at a token whose margin is within twice `tolerance` (tests/tolerances.py's
      forward_tolerance for the model: how far a logit of two correct float32 forwards may be
      apart): a near-tie, which either pick may take;
    - at the first token, or at or just after a token whose text is not whole on its own (a byte
      of a multi-byte character, which an incremental detokenizer holds back or joins to its
      neighbour): a detokenizer seam, where text cannot tell a wrong token from another way of
      printing the same ones: counted apart, as unverified;
    - anywhere else: a wrong token."""

    token_ids: dict[int, list[int]]
    margins: dict[int, list[float]]
    decode: Callable[[list[int]], str]
    tolerance: float

    def divergence(self, index: int, text: str) -> tuple[int | None, float | None]:
        """The first of PEFT's tokens the text does not follow, and its margin (None, None: the text
        follows every token, or PEFT has no tokens for the request)."""
        ids, margins = self.token_ids.get(index), self.margins.get(index)
        if not ids or not margins:
            return None, None
        for step in range(len(ids)):
            if not text.startswith(self.decode(ids[:step + 1])):
                return step, margins[step]
        return None, None

    def id_divergence(self, index: int, ids: list[int]) -> tuple[int | None, float | None]:
        """The first step where `ids` leave PEFT's greedy tokens, and PEFT's margin there."""
        ref, margins = self.token_ids.get(index) or [], self.margins.get(index) or []
        for step, (mine, theirs) in enumerate(zip(ids, ref)):
            if mine != theirs:
                return step, margins[step] if step < len(margins) else None
        return (None, None) if len(ids) == len(ref) else (min(len(ids), len(ref)), None)

    def first_difference(self, index: int, output: Output, by_ids: bool) -> tuple[int | None, float | None]:
        """Where `output` leaves PEFT's tokens: by its token ids, or by its text."""
        return self.id_divergence(index, output.token_ids or []) if by_ids else self.divergence(index, output.text)

    def kind(self, index: int, step: int | None, margin: float | None, *, by_ids: bool = False) -> str:
        """wrong, near_tie or seam (class docstring) for an output that left PEFT's at `step`; compared
        by token ids, only a near-tie excuses a difference."""
        if step is None or margin is None:
            return "wrong"
        if margin <= 2 * self.tolerance:
            return "near_tie"
        if by_ids:
            return "wrong"
        ids = self.token_ids[index]
        if step == 0 or any("\ufffd" in self.decode([i]) for i in ids[max(0, step - 1):step + 1]):
            return "seam"
        return "wrong"


def check_texts(entries: list[dict[str, Any]], outputs: dict[str, dict[int, Output] | None],
                reference: Reference | None = None) -> None:
    """Each system's output for every request both it and PEFT finished, against PEFT's: token by
    token where the system named its token ids, else by text. A difference counts as wrong unless
    `reference` shows it left PEFT's at a near-tie, or (text only) at a detokenizer seam
    (Reference): wrong tokens are reported, never averaged away."""
    ref = outputs.get(REFERENCE)
    for entry in entries:
        own = outputs.get(entry["system"])
        if entry["system"] == REFERENCE or ref is None or own is None:
            continue
        both = [i for i in own if i in ref]
        by_ids = {i for i in both if own[i].token_ids is not None and ref[i].token_ids is not None}
        differ = [i for i in both if (own[i].token_ids != ref[i].token_ids if i in by_ids
                                      else own[i].text != ref[i].text)]
        found = {i: reference.first_difference(i, own[i], i in by_ids) if reference else (None, None)
                 for i in differ}
        kinds = {i: reference.kind(i, *found[i], by_ids=i in by_ids) if reference else "wrong" for i in differ}
        wrong = [i for i in differ if kinds[i] == "wrong"]
        entry.update(checked_outputs=len(both), checked_by_token_ids=len(by_ids), wrong_outputs=len(wrong),
                     near_tie_outputs=sum(k == "near_tie" for k in kinds.values()),
                     seam_outputs=sum(k == "seam" for k in kinds.values()), first_wrong=wrong[:5],
                     divergences=[{"index": i, "token": found[i][0], "peft_margin": found[i][1], "kind": kinds[i]}
                                  for i in differ][:10])
        if reference:
            entry["near_tie_margin"] = 2 * reference.tolerance


def add_slowdowns(results: list[dict[str, Any]]) -> None:
    """Each adapter run's throughput under the same system's base-model run (base / adapters)."""
    base = {r["system"]: r["output_tokens_per_s"] for r in results if r["base_only"] and r["ok"]}
    for r in results:
        own_base = base.get(r["system"])
        if not r["base_only"] and r["ok"] and own_base and r["output_tokens_per_s"]:
            r["slowdown_vs_base"] = round(own_base / r["output_tokens_per_s"], 3)


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per sweep point: loraplex's throughput over each other system's on the same adapters and
    over its base-model run, and every system's slowdown."""
    tok = {(r["point"], r["system"]): r["output_tokens_per_s"] for r in results if r["ok"]}
    out: dict[str, dict[str, float]] = {}
    for point in dict.fromkeys(r["point"] for r in results if not r["base_only"]):
        ours, these = tok.get((point, "loraplex")), {}
        for system in dict.fromkeys(r["system"] for r in results):
            theirs, theirs_base = tok.get((point, system)), tok.get(("base", system))
            if ours and theirs and system != "loraplex":
                these[f"loraplex_over_{system}"] = round(ours / theirs, 3)
            if ours and theirs_base:
                these[f"loraplex_over_{system}_base"] = round(ours / theirs_base, 3)
            if theirs and theirs_base:
                these[f"{system}_slowdown"] = round(theirs_base / theirs, 3)
        out[point] = these
    return out


def cold_summary(cold_ttft_ms: list[float], warm_ttft_ms: list[float]) -> dict[str, Any]:
    cold, warm = statistics.median(cold_ttft_ms), statistics.median(warm_ttft_ms)
    return {"cold_ttft_ms": [round(x, 1) for x in cold_ttft_ms], "warm_ttft_ms": [round(x, 1) for x in warm_ttft_ms],
            "cold_ttft_p50_ms": round(cold, 1), "warm_ttft_p50_ms": round(warm, 1),
            "cold_over_warm": round(cold / warm, 3) if warm > 0 else None}


def table(report: dict[str, Any]) -> str:
    lines = ["| workload | system | tok/s | slowdown | TTFT p50 / p99 ms | TPOT p50 / p99 ms | done | peak MB "
             "| wrong (+ near-ties, seams) / checked | cold / warm TTFT |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if not r["ok"]:
            lines.append(f"| {r['point']} | {r['system']} | not run: {r['reason'][:90]} | | | | | | | |")
            continue
        checked = ("-" if r["checked_outputs"] is None else
                   f"{r['wrong_outputs']} (+{r.get('near_tie_outputs', 0)} ties, {r.get('seam_outputs', 0)} seams) "
                   f"/ {r['checked_outputs']}")
        cold = r.get("cold") or {}
        cold_text = (f"{cold['cold_ttft_p50_ms']} / {cold['warm_ttft_p50_ms']} ms" if cold else "-")
        peak = "-" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}"
        lines.append(f"| {r['point']} | {r['system']} | {r['output_tokens_per_s']} | {r.get('slowdown_vs_base', '-')} "
                     f"| {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} "
                     f"| {r['finished']}/{r['finished'] + r['failed']} | {peak} | {checked} | {cold_text} |")
    lines += ["", json.dumps(report["ratios"], indent=1)]
    return "\n".join(lines)
