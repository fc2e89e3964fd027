"""The one workload every system of bench/peers.py serves, and the open-loop client that drives a
server with it.

A workload is seeded and fixed before any system starts: each request's arrival time (Poisson
at `rate`), prompt (random token ids), output length and adapter (uniform or Zipf over the
adapters, or none for the base model), so every system sees exactly the same requests at the
same times. The client posts each at its time to an OpenAI-compatible `/v1/completions` (token
ids as the prompt, greedy, `ignore_eos`, streamed) and times its first token and its end. It asks
for each token's id too (`logprobs: 0` with vLLM's `return_tokens_as_token_ids`, which both vLLM
and loraplex's gateway serve), so outputs are compared token by token, not through a detokenizer.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

POPULARITIES = ("uniform", "zipf")


@dataclass(frozen=True, slots=True)
class PeerRequest:
    index: int
    arrival_s: float  # from the start of the run
    prompt: list[int]
    max_tokens: int
    adapter: str | None  # None: the base model


@dataclass(slots=True)
class PeerResult:
    index: int
    ok: bool
    ttft_s: float | None = None  # arrival to first token
    e2e_s: float | None = None  # arrival to last token
    tokens: int = 0
    text: str = ""
    error: str = ""
    token_ids: list[int] | None = None  # None: the server named no ids (then only the text is compared)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


def make_workload(*, seed: int, requests: int, rate: float, adapters: list[str], popularity: str,
                  prompt_len: int, max_tokens: int, vocab: tuple[int, int]) -> list[PeerRequest]:
    """`requests` requests over `adapters` (empty: every request on the base model); Zipf 1.0
    ranks them in the listed order. vocab: the [low, high) token ids prompts are drawn from."""
    if popularity not in POPULARITIES:
        raise ValueError(f"popularity must be one of {POPULARITIES}, got {popularity!r}")
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) if popularity == "zipf" else 1.0 for i in range(len(adapters))]
    out, t = [], 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        adapter = rng.choices(adapters, weights)[0] if adapters else None
        prompt = [rng.randrange(*vocab) for _ in range(prompt_len)]
        out.append(PeerRequest(i, round(t, 6), prompt, max_tokens, adapter))
    return out


def summarize(results: list[PeerResult], elapsed_s: float) -> dict[str, Any]:
    """Output tokens/s over the run, TTFT and TPOT p50/p99 (ms), requests finished and failed."""
    done = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in done)

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 2)

    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [t for r in done if (t := r.tpot_s) is not None]
    return {"output_tok_s": round(tokens / elapsed_s, 3) if elapsed_s > 0 else None, "elapsed_s": round(elapsed_s, 3),
            "finished": len(done), "failed": len(results) - len(done), "output_tokens": tokens,
            "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
            "tpot_ms_p50": pct(tpot, 0.5), "tpot_ms_p99": pct(tpot, 0.99),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


async def _one(session: aiohttp.ClientSession, url: str, base_model: str, req: PeerRequest, start: float,
               timeout_s: float) -> PeerResult:
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    arrived = start + req.arrival_s
    body = {"model": req.adapter or base_model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 0, "return_tokens_as_token_ids": True}
    result = PeerResult(req.index, ok=False)
    parts: list[str] = []
    labels: list[str] = []
    events = 0
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or []:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - arrived
                    parts.append(choice.get("text") or "")
                    labels.extend((choice.get("logprobs") or {}).get("tokens") or [])
                    events += 1
                if event.get("usage"):  # the last event: the count the server generated
                    result.tokens = int(event["usage"].get("completion_tokens") or 0)
        result.e2e_s = time.perf_counter() - arrived
        result.tokens = result.tokens or events
        result.text = "".join(parts)
        result.token_ids = token_ids(labels)
        result.ok = result.tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


def token_ids(labels: list[str]) -> list[int] | None:
    """The ids of "token_id:N" labels; None when there are none or any is spelled otherwise."""
    ids = [int(label[9:]) for label in labels if label.startswith("token_id:") and label[9:].isdigit()]
    return ids if labels and len(ids) == len(labels) else None


async def drive(url: str, base_model: str, workload: list[PeerRequest], *,
                timeout_s: float) -> tuple[list[PeerResult], float]:
    """Every request sent at its arrival time, none waiting for another (open loop)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, base_model, r, start, timeout_s) for r in workload))
        return list(results), time.perf_counter() - start


def workload_json(workload: list[PeerRequest]) -> list[dict[str, Any]]:
    return [asdict(r) for r in workload]
