"""Profiling-guided parallelisation (Toppings §4.2): measure what one core does,
then give a prompt ceil(L / c) worker processes.

Owns the CPU profile (token-modules per second per core for each rank, at one
hidden size, measured with the workers' single-thread kernel), its JSON cache
keyed by CPU model, hidden size, dtype and torch version, and the planner that
turns a prompt length, a rank and a time budget into a worker count and a row
split. Torch-free at import: the daemon plans and loads cached profiles
without torch; `measure` imports torch only when it runs (in a worker, or in
a benchmark).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    from loraplex.cpu_lora.pool import CpuWorkerPool

CALIBRATION_RANKS: tuple[int, ...] = (8, 16, 32, 64, 128)
CALIBRATION_TOKENS = 256
PROFILE_VERSION = 1


# -- measurement (imports torch when called) ----------------------------------


def measure(hidden: int, ranks: Sequence[int] = CALIBRATION_RANKS, *, tokens: int = CALIBRATION_TOKENS,
            repeats: int = 5, dtype: str = "float32", seed: int = 0) -> list[float]:
    """Tokens per second through one hidden x hidden LoRA module, per rank, with
    lora_delta on the calling thread's current torch thread count (1 in a worker;
    see `single_thread`). Median of `repeats` timed calls after one warm-up."""
    import torch

    from loraplex.cpu_lora.compute import lora_delta, store_dtype

    if hidden < 1 or tokens < 1 or repeats < 1:
        raise ValueError(f"hidden, tokens and repeats must be >= 1, got {hidden}, {tokens}, {repeats}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)  # [T, hidden]
    out = torch.empty(tokens, hidden)  # [T, hidden]
    rates = []
    for rank in ranks:
        a = (torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)).to(store_dtype(dtype))  # [r, hidden]
        bt = (torch.randn(rank, hidden, generator=gen) / math.sqrt(rank)).to(store_dtype(dtype))  # [r, hidden]
        lora_delta(x, a, bt, 2.0, out)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            lora_delta(x, a, bt, 2.0, out)
            times.append(time.perf_counter() - started)
        rates.append(tokens / max(statistics.median(times), 1e-9))
    return rates


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the enclosed torch code on one intra-op thread, as a worker does."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the profile ----------------------------------------------------------------


def cpu_model_name() -> str:
    """The CPU model (/proc/cpuinfo `model name`), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def torch_version() -> str:
    """The installed torch version, read from package metadata (torch is not imported)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@dataclass(frozen=True, slots=True)
class CpuProfile:
    """tokens_per_s[i]: tokens per second one core pushes through one hidden x hidden
    LoRA module of rank ranks[i] (`tokens` rows per call, store `dtype`)."""

    hidden: int
    ranks: tuple[int, ...]
    tokens_per_s: tuple[float, ...]
    tokens: int = CALIBRATION_TOKENS
    dtype: str = "float32"
    cpu_model: str = field(default_factory=cpu_model_name)
    torch_version: str = field(default_factory=torch_version)

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.tokens < 1:
            raise ValueError(f"profile hidden and tokens must be >= 1, got {self.hidden}, {self.tokens}")
        if not self.ranks or len(self.ranks) != len(self.tokens_per_s):
            raise ValueError("a profile needs one throughput per rank, and at least one rank")
        if list(self.ranks) != sorted(set(self.ranks)) or self.ranks[0] < 1:
            raise ValueError(f"profile ranks must be positive and strictly increasing, got {self.ranks}")
        if not all(math.isfinite(t) and t > 0 for t in self.tokens_per_s):
            raise ValueError(f"profile throughputs must be positive and finite, got {self.tokens_per_s}")

    def throughput(self, rank: int) -> float:
        """Tokens per second per core at `rank`: seconds per token interpolated linearly
        between measured ranks, proportional to rank above the largest, and the
        smallest rank's figure below it (never optimistic)."""
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        secs = [1.0 / t for t in self.tokens_per_s]
        if rank <= self.ranks[0]:
            return self.tokens_per_s[0]
        if rank >= self.ranks[-1]:
            return 1.0 / (secs[-1] * rank / self.ranks[-1])
        for (r0, s0), (r1, s1) in zip(zip(self.ranks, secs), zip(self.ranks[1:], secs[1:])):
            if r0 <= rank <= r1:
                return 1.0 / (s0 + (s1 - s0) * (rank - r0) / (r1 - r0))
        raise AssertionError("unreachable: ranks are sorted")

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "hidden": self.hidden, "ranks": list(self.ranks),
                "tokens_per_s": list(self.tokens_per_s), "tokens": self.tokens, "dtype": self.dtype,
                "cpu_model": self.cpu_model, "torch_version": self.torch_version}

    @classmethod
    def from_json(cls, data: dict) -> CpuProfile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        return cls(hidden=int(data["hidden"]), ranks=tuple(int(r) for r in data["ranks"]),
                   tokens_per_s=tuple(float(t) for t in data["tokens_per_s"]), tokens=int(data["tokens"]),
                   dtype=str(data["dtype"]), cpu_model=str(data["cpu_model"]),
                   torch_version=str(data["torch_version"]))


def calibrate_local(hidden: int, ranks: Sequence[int] = CALIBRATION_RANKS, *, tokens: int = CALIBRATION_TOKENS,
                    repeats: int = 5, dtype: str = "float32") -> CpuProfile:
    """Measure in this process on one thread (benchmarks, tests, a daemon-less host)."""
    with single_thread():
        rates = measure(hidden, ranks, tokens=tokens, repeats=repeats, dtype=dtype)
    return CpuProfile(hidden=hidden, ranks=tuple(ranks), tokens_per_s=tuple(rates), tokens=tokens, dtype=dtype)


# -- the cache --------------------------------------------------------------------


def default_cache_dir() -> Path:
    """$LORAPLEX_CACHE_DIR, else $XDG_CACHE_HOME/loraplex, else ~/.cache/loraplex."""
    if explicit := os.environ.get("LORAPLEX_CACHE_DIR"):
        return Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "loraplex"
    return Path.home() / ".cache" / "loraplex"


def profile_path(hidden: int, *, dtype: str = "float32", tokens: int = CALIBRATION_TOKENS,
                 cache_dir: Path | None = None, cpu_model: str | None = None, torch_ver: str | None = None) -> Path:
    """Where the profile for this CPU model, hidden size, dtype, row count and torch version lives."""
    key = "|".join([cpu_model or cpu_model_name(), str(hidden), dtype, str(tokens), torch_ver or torch_version()])
    digest = hashlib.blake2s(key.encode(), digest_size=8).hexdigest()
    return (cache_dir or default_cache_dir()) / "cpu_lora" / f"profile-h{hidden}-{dtype}-{digest}.json"


def load_profile(hidden: int, *, dtype: str = "float32", tokens: int = CALIBRATION_TOKENS,
                 ranks: Iterable[int] = CALIBRATION_RANKS, cache_dir: Path | None = None) -> CpuProfile | None:
    """The cached profile for this host, or None if absent, unreadable, or missing a rank."""
    path = profile_path(hidden, dtype=dtype, tokens=tokens, cache_dir=cache_dir)
    try:
        profile = CpuProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if profile.hidden != hidden or profile.dtype != dtype or not set(ranks) <= set(profile.ranks):
        return None
    return profile


def save_profile(profile: CpuProfile, cache_dir: Path | None = None) -> Path:
    """Write atomically (rename), so a concurrent reader never sees half a file."""
    path = profile_path(profile.hidden, dtype=profile.dtype, tokens=profile.tokens, cache_dir=cache_dir,
                        cpu_model=profile.cpu_model, torch_ver=profile.torch_version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_json(), indent=1))
    os.replace(tmp, path)
    return path


async def load_or_calibrate(pool: CpuWorkerPool, hidden: int, *, ranks: Sequence[int] = CALIBRATION_RANKS,
                            tokens: int = CALIBRATION_TOKENS, repeats: int = 5, dtype: str = "float32",
                            cache_dir: Path | None = None, refresh: bool = False) -> CpuProfile:
    """The cached profile, or a fresh one measured by a pool worker on its own core
    (the real single-thread worker path) and cached. Torch-free in the caller."""
    if not refresh:
        cached = load_profile(hidden, dtype=dtype, tokens=tokens, ranks=ranks, cache_dir=cache_dir)
        if cached is not None:
            return cached
    answer = await pool.calibrate(hidden, list(ranks), tokens=tokens, repeats=repeats, dtype=dtype)
    order = sorted(range(len(answer.ranks)), key=lambda i: answer.ranks[i])
    profile = CpuProfile(hidden=hidden, ranks=tuple(answer.ranks[i] for i in order),
                         tokens_per_s=tuple(answer.tokens_per_s[i] for i in order), tokens=tokens, dtype=dtype,
                         cpu_model=answer.cpu_model or cpu_model_name(),
                         torch_version=answer.torch_version or torch_version())
    save_profile(profile, cache_dir)
    return profile


# -- planning ----------------------------------------------------------------------


def module_work(in_features: int, out_features: int, hidden: int) -> float:
    """A module's cost in units of one hidden x hidden module (cost ∝ r·(in + out))."""
    return (in_features + out_features) / (2.0 * hidden)


def split_rows(total: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) of `parts` contiguous, nearly equal row ranges covering [0, total);
    earlier parts take the remainder. Never yields an empty part."""
    if total < 0 or parts < 1:
        raise ValueError(f"need total >= 0 and parts >= 1, got {total}, {parts}")
    parts = min(parts, total) or 1
    size, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        count = size + (1 if i < extra else 0)
        out.append((start, count))
        start += count
    return [p for p in out if p[1] > 0]


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """num_workers processes, each taking splits[i] = (row offset, rows) of the prompt.

    capacity: c, the tokens one core finishes within the budget;
    expected_ms: estimated time of the busiest worker; within_budget: whether
    expected_ms fits the budget (False only when max_workers capped the count).
    """

    num_workers: int
    capacity: int
    splits: list[tuple[int, int]]
    expected_ms: float
    within_budget: bool


def plan_parallelism(prompt_len: int, rank: int, profile: CpuProfile, per_request_budget_ms: float, *,
                     work_units: float = 1.0, max_workers: int | None = None) -> ParallelPlan:
    """Workers for one request's CPU LoRA work (Toppings §4.2): ceil(L / c) with
    c = floor(throughput(rank) / work_units · budget), at least 1.

    `work_units` is the work per token within the budget in hidden x hidden
    module units (sum of module_work over the modules the budget covers, e.g.
    one layer's target modules when the budget is one layer's GPU time).
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if not per_request_budget_ms > 0 or not work_units > 0:
        raise ValueError(f"budget and work_units must be > 0, got {per_request_budget_ms}, {work_units}")
    if max_workers is not None and max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    tokens_per_s = profile.throughput(rank) / work_units
    capacity = max(1, int(tokens_per_s * per_request_budget_ms / 1e3))
    workers = math.ceil(prompt_len / capacity)
    if max_workers is not None:
        workers = min(workers, max_workers)
    splits = split_rows(prompt_len, workers)
    expected_ms = max(count for _, count in splits) / tokens_per_s * 1e3
    return ParallelPlan(num_workers=len(splits), capacity=capacity, splits=splits, expected_ms=expected_ms,
                        within_budget=len(splits) * capacity >= prompt_len)
