"""CPU-assisted prefill planning (Toppings §4): for each row whose adapter is
still arriving, how many leading layers run on CPU workers, which workers
take which exchange rows, and how many dones each layer's sites expect.

Torch-free policy. Costs come from the engine's hello (link bandwidth), the
daemon's step history (engine time per token and layer) and the workers'
calibration (tokens/s per core by rank).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from loraplex.contracts.layer_groups import layer_groups
from loraplex.cpu_lora.calibration import split_rows
from loraplex.ipc.engine_plan import CpuAssistStep, RowPlan, StepPlan


@dataclass(slots=True)
class CpuCosts:
    num_layers: int
    link_bytes_per_s: float
    layer_ms_per_token: float = 0.05  # refined from observed steps
    cpu_tokens_per_s: dict[int, float] = field(default_factory=dict)  # per worker core, by rank

    def observe_step(self, engine_ms: float, tokens: int) -> None:
        """Exponential moving average of the engine's compute per token per layer."""
        if tokens <= 0 or engine_ms <= 0:
            return
        sample = engine_ms / tokens / self.num_layers
        self.layer_ms_per_token = 0.8 * self.layer_ms_per_token + 0.2 * sample

    def cpu_rate(self, rank: int) -> float:
        if not self.cpu_tokens_per_s:
            return 2000.0
        best = min(self.cpu_tokens_per_s, key=lambda r: abs(r - rank))
        return self.cpu_tokens_per_s[best] * best / max(rank, 1)


def choose_cpu_layers(costs: CpuCosts, adapter_bytes: int, load_groups: int, tokens: int) -> int:
    """Leading layers to compute on CPU: every group that would arrive after compute reaches it."""
    if costs.link_bytes_per_s <= 0 or adapter_bytes <= 0:
        return 0
    groups = layer_groups(costs.num_layers, load_groups)
    per_group_s = adapter_bytes / len(groups) / costs.link_bytes_per_s
    layer_s = tokens * costs.layer_ms_per_token / 1e3
    cpu_layers = 0
    for g, part in enumerate(groups):
        arrives = (g + 1) * per_group_s
        reached = part.start * layer_s
        if arrives > reached:
            cpu_layers = part.stop
    return cpu_layers


@dataclass(frozen=True, slots=True)
class WorkerSlice:
    """Exchange rows [xrow, xrow+count) of one request, handled by one worker for layers [0, cpu_layers)."""

    request_id: str
    adapter: str
    xrow: int
    count: int
    cpu_layers: int


@dataclass(slots=True)
class CpuStepPlan:
    plan: StepPlan
    slices: dict[int, list[WorkerSlice]]  # worker index -> its slices


def plan_cpu_assist(plan: StepPlan, *, seq: int, costs: CpuCosts, workers: list[int], exchange_rows: int,
                    adapter_info: dict[str, tuple[int, int]], load_groups: int,
                    budget_ms: float = 50.0) -> CpuStepPlan:
    """Give prefill rows of adapters placed in this step CPU layers and workers.

    adapter_info: name -> (bytes, rank). Rows that do not fit in the exchange
    buffer, or when no worker is up, simply wait for their layer groups.
    """
    placed = {p.name for p in plan.place} & set(adapter_info)
    if not workers or not placed:
        return CpuStepPlan(plan, {})
    rows: list[RowPlan] = []
    slices: dict[int, list[WorkerSlice]] = {}
    next_xrow, next_worker = 0, 0
    for row in plan.rows:
        n = len(row.token_ids)
        if row.adapter not in placed or n < 2 or next_xrow + n > exchange_rows:
            rows.append(row)
            continue
        nbytes, rank = adapter_info[row.adapter]
        cpu_layers = choose_cpu_layers(costs, nbytes, load_groups, n)
        if cpu_layers == 0:
            rows.append(row)
            continue
        per_worker = max(1, int(costs.cpu_rate(rank) * budget_ms / 1e3))
        wanted = min(len(workers), math.ceil(n / per_worker))
        for offset, count in split_rows(n, wanted):
            worker = workers[next_worker % len(workers)]
            next_worker += 1
            slices.setdefault(worker, []).append(
                WorkerSlice(row.request_id, row.adapter, next_xrow + offset, count, cpu_layers))
        rows.append(dataclasses.replace(row, cpu_layers=cpu_layers, cpu_row=next_xrow))
        next_xrow += n
    if not slices:
        return CpuStepPlan(plan, {})
    per_layer = [sum(1 for ss in slices.values() if any(s.cpu_layers > layer for s in ss))
                 for layer in range(costs.num_layers)]
    cpu = CpuAssistStep(seq=seq, workers_per_layer=per_layer, exchange_rows=next_xrow)
    return CpuStepPlan(dataclasses.replace(plan, rows=rows, cpu=cpu), slices)
