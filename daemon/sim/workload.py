"""Seeded request workloads (torch-free), shared by the simulator and the live load generator.

Arrivals: Poisson, Gamma (rate and coefficient of variation) or the Azure LLM inference
trace's own timestamps (re-based to zero, divided by `time_scale`). Adapter popularity is
Zipf, P(i) ∝ 1/(i+1)^zipf_exponent; each adapter draws its rank from the rank mix. Prompt
and output lengths are log-normal or replayed from the trace in file order. The same spec
always yields the same events; nothing here reads a clock or keeps global state.
"""
from __future__ import annotations

import array
import csv
import functools
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

TRACES_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
TRACE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
ARRIVALS = ("poisson", "gamma", "trace")
LENGTHS = ("lognormal", "fixed", "trace")
RANKS = (8, 16, 32, 64, 128)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    request_id: str
    arrival_s: float
    adapter: str | None  # None: the base model
    rank: int  # 0 for the base model
    prompt_len: int
    output_len: int
    # A turn of a multi-turn conversation: its prompt is the conversation's token stream up to
    # prompt_len (each turn's prompt extends the last); None: a prompt of its own.
    conversation: str | None = None

    @property
    def prompt_key(self) -> str:
        """What its prompt tokens are built from (prompt_tokens)."""
        return self.conversation or self.request_id


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    seed: int = 0
    duration_s: float = 60.0
    max_requests: int | None = None  # stop after this many requests (None: the duration decides)
    arrival: str = "poisson"  # poisson | gamma | trace
    rate_rps: float = 4.0
    cv: float = 1.0  # gamma: coefficient of variation of the gaps (1.0 is Poisson)
    num_adapters: int = 32
    zipf_exponent: float = 1.0
    ranks: tuple[int, ...] = RANKS
    rank_weights: tuple[float, ...] | None = None  # None: uniform over `ranks`
    base_fraction: float = 0.0  # share of requests to the base model (no adapter)
    lengths: str = "lognormal"  # lognormal | fixed | trace
    prompt_mean: int = 512  # lognormal: median tokens; fixed: the length
    prompt_sigma: float = 0.8
    output_mean: int = 128
    output_sigma: float = 0.8
    max_prompt: int = 2048
    max_output: int = 1024
    trace: str = "conv"  # conv | code | a CSV path
    time_scale: float = 1.0  # trace arrivals: speed-up factor (2.0 replays twice as fast)

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {LENGTHS}, got {self.lengths!r}")
        if not (self.duration_s > 0 and self.rate_rps > 0 and self.cv > 0 and self.time_scale > 0):
            raise ValueError("duration_s, rate_rps, cv and time_scale must be positive")
        if self.max_requests is not None and self.max_requests <= 0:
            raise ValueError("max_requests must be positive (or None)")
        if self.num_adapters <= 0 or self.zipf_exponent < 0 or not 0 <= self.base_fraction <= 1:
            raise ValueError("num_adapters must be positive, zipf_exponent >= 0, base_fraction in [0, 1]")
        if not self.ranks or min(self.ranks) <= 0:
            raise ValueError("ranks must be positive")
        if self.rank_weights is not None and (len(self.rank_weights) != len(self.ranks)
                                              or min(self.rank_weights) < 0 or sum(self.rank_weights) <= 0):
            raise ValueError("rank_weights must give one non-negative weight per rank, not all zero")
        if min(self.prompt_mean, self.output_mean, self.max_prompt, self.max_output) <= 0:
            raise ValueError("length means and caps must be positive")

    @property
    def adapter_names(self) -> list[str]:
        return [f"lora{i:04d}" for i in range(self.num_adapters)]


def prompt_tokens(request_id: str, length: int, vocab: int = 32000) -> list[int]:
    """A request's prompt token ids: the same for the same request id wherever it is built (the
    simulator, the load generator, tests against a live daemon), and distinct between requests,
    so that the prefix cache finds a request's own pages again (after a preemption) and no
    other request's, in the simulator as in a live daemon."""
    words = array.array("I", random.Random(zlib.crc32(request_id.encode())).randbytes(4 * length))
    span = vocab - 3
    return [3 + w % span for w in words]


def adapter_ranks(spec: WorkloadSpec) -> dict[str, int]:
    """Each adapter's rank, drawn from the rank mix (own stream, so it does not move with lengths)."""
    rng = random.Random(f"ranks/{spec.seed}")
    return {name: rng.choices(spec.ranks, spec.rank_weights)[0] for name in spec.adapter_names}


def zipf_weights(n: int, exponent: float) -> list[float]:
    return [1.0 / (i + 1) ** exponent for i in range(n)]


def trace_path(trace: str) -> Path:
    return TRACES_DIR / TRACE_FILES[trace] if trace in TRACE_FILES else Path(trace)


@functools.lru_cache(maxsize=4)
def read_trace(path: Path) -> tuple[tuple[float, int, int], ...]:
    """(seconds since the first request, context tokens, generated tokens) per row, in file order."""
    from datetime import datetime

    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            stamp = r["TIMESTAMP"].strip()
            head, _, frac = stamp.partition(".")
            t = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)
            rows.append((t, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    if not rows:
        raise ValueError(f"{path}: no rows")
    t0 = rows[0][0]
    return tuple((t - t0, c, g) for t, c, g in rows)


def _arrivals(spec: WorkloadSpec, rng: random.Random, trace: tuple[tuple[float, int, int], ...] | None) -> list[float]:
    limit = spec.max_requests if spec.max_requests is not None else math.inf
    out: list[float] = []
    if spec.arrival == "trace":
        for t, _, _ in trace or ():
            t /= spec.time_scale
            if t >= spec.duration_s or len(out) >= limit:
                break
            out.append(t)
        return out
    t = 0.0
    shape = 1.0 / spec.cv ** 2
    while len(out) < limit:
        if spec.arrival == "poisson":
            t += rng.expovariate(spec.rate_rps)
        else:
            t += rng.gammavariate(shape, 1.0 / (spec.rate_rps * shape))
        if t >= spec.duration_s:
            break
        out.append(t)
    return out


def _length(rng: random.Random, kind: str, mean: int, sigma: float, cap: int) -> int:
    if kind == "fixed":
        return min(mean, cap)
    return max(1, min(cap, int(round(rng.lognormvariate(math.log(mean), sigma)))))


def generate(spec: WorkloadSpec) -> list[RequestEvent]:
    """The workload's requests in arrival order (ids r000000, r000001, ...)."""
    uses_trace = spec.arrival == "trace" or spec.lengths == "trace"
    trace = read_trace(trace_path(spec.trace)) if uses_trace else None
    rng = random.Random(spec.seed)
    arrivals = _arrivals(spec, rng, trace)
    ranks = adapter_ranks(spec)
    names = spec.adapter_names
    weights = zipf_weights(spec.num_adapters, spec.zipf_exponent)
    pick = random.Random(f"adapters/{spec.seed}")
    lens = random.Random(f"lengths/{spec.seed}")
    events: list[RequestEvent] = []
    for i, t in enumerate(arrivals):
        adapter = None if pick.random() < spec.base_fraction else pick.choices(names, weights)[0]
        if spec.lengths == "trace" and trace:
            _, prompt, output = trace[i % len(trace)]
            prompt, output = max(1, min(prompt, spec.max_prompt)), max(1, min(output, spec.max_output))
        else:
            prompt = _length(lens, spec.lengths, spec.prompt_mean, spec.prompt_sigma, spec.max_prompt)
            output = _length(lens, spec.lengths, spec.output_mean, spec.output_sigma, spec.max_output)
        events.append(RequestEvent(f"r{i:06d}", t, adapter, 0 if adapter is None else ranks[adapter], prompt, output))
    return events
