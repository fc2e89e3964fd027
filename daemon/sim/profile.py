"""Latency model of one engine for the simulator (torch-free): how long a step, an adapter
load and a CPU-side LoRA computation take. Plain data with illustrative defaults (not a
measurement); load a profiled engine's numbers from JSON for real predictions.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS
from loraplex.daemon.json_file import read_json_file
from loraplex.daemon.router.rank_aware import KernelCost, PerfProfile

MIB = 1 << 20


@functools.lru_cache(maxsize=64)  # built once per profile, not once per simulated step
def _perf(alpha_ms: float, beta_ms: float) -> PerfProfile:
    cost = KernelCost(alpha=alpha_ms, beta=beta_ms)
    return PerfProfile(bgmv=cost, mbgmv=cost)


@dataclass(frozen=True, slots=True)
class SimProfile:
    # Step = alpha·Σrank (or BGMV padding) + beta  [the router's PERF model]
    #      + prefill_ms_per_token·prefill tokens + decode_ms_per_row·decode rows.
    kernel: str = "mbgmv"
    alpha_ms: float = 0.01  # ms per rank unit of the LoRA kernel
    beta_ms: float = 8.0  # ms, fixed cost of a step
    prefill_ms_per_token: float = 0.12
    decode_ms_per_row: float = 0.25
    bytes_per_rank: int = 2 * MIB  # a rank-r q/k/v/o adapter of a 7B model is about 2·r MiB
    pcie_bytes_per_s: float = 8e9  # host -> GPU link, one load at a time
    rank_per_page: int = 4  # adapter pages = ceil(rank / rank_per_page)
    cpu_lora_rank_tokens_per_s: float = 2.5e6  # CPU LoRA throughput, in token·rank units per second
    pool_pages: int = 4000
    page_tokens: int = 16
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_batched_tokens: int = 4096
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.kernel not in ("bgmv", "mbgmv"):
            raise ValueError(f"kernel must be bgmv or mbgmv, got {self.kernel!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "kernel" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"profile {f.name} must be a finite number >= 0, got {value!r}")
        if min(self.pcie_bytes_per_s, self.cpu_lora_rank_tokens_per_s, self.rank_per_page, self.pool_pages,
               self.page_tokens, self.max_num_seqs, self.max_batched_tokens, self.max_model_len) <= 0:
            raise ValueError("profile bandwidths, throughputs and limits must be positive")

    @property
    def perf(self) -> PerfProfile:
        return _perf(self.alpha_ms, self.beta_ms)

    def step_ms(self, lora_ranks: list[int], prefill_tokens: int, decode_rows: int) -> float:
        return (self.perf.step_ms(self.kernel, lora_ranks)  # type: ignore[arg-type]
                + self.prefill_ms_per_token * prefill_tokens + self.decode_ms_per_row * decode_rows)

    def adapter_bytes(self, rank: int) -> int:
        return rank * self.bytes_per_rank

    def adapter_pages(self, rank: int) -> int:
        return max(1, math.ceil(rank / self.rank_per_page))

    def load_s(self, rank: int) -> float:
        return self.adapter_bytes(rank) / self.pcie_bytes_per_s

    def cpu_lora_s(self, tokens: int, rank: int) -> float:
        return tokens * rank / self.cpu_lora_rank_tokens_per_s

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def override(self, assignments: list[str]) -> SimProfile:
        """This profile with FIELD=VALUE assignments applied (e.g. "kernel=mbgmv", "beta_ms=12")."""
        changes: dict[str, object] = {}
        for item in assignments:
            name, sep, text = item.partition("=")
            if not sep or name not in {f.name for f in fields(self)}:
                raise ValueError(f"profile override {item!r}: want FIELD=VALUE with FIELD a SimProfile field")
            kind = type(getattr(self, name))
            try:
                changes[name] = kind(text) if kind is not int else int(float(text))
            except ValueError:
                raise ValueError(f"profile override {item!r}: {text!r} is not a {kind.__name__}") from None
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, raw: object) -> SimProfile:
        if not isinstance(raw, dict):
            raise ValueError("a simulator profile must be a JSON object")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown profile fields: {unknown}")
        return cls(**raw)

    @classmethod
    def load(cls, path: str | Path) -> SimProfile:
        return cls.from_dict(read_json_file(path))
