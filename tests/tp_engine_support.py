"""Test support for tensor-parallel engines below the daemon: N rank processes, each
building its runtime from an EngineSpec as the engine does (build_runtime over a
joined RankLink), driven with protocol orders the way the engine process drives them:
rank 0 shares each order (the other ranks run gpu_engine/tp/worker.serve), runs it and
settles the group's verdict. Rank 0 writes its greedy tokens and logprobs, and what its
collectives carried, to a safetensors file, never pickled; the spawn arguments are plain
strings and ints. This is the one tensor-parallel path: the engine's own (no test-only
executor or batch builder)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.ipc.engine_plan import AdapterPlacement, RowPlan, SamplingSpec, StepPlan
from loraplex.ipc.protocol import EngineAdapterLoaded, EngineFailure, EngineLoadAdapter, EngineStep, EngineStepDone

GREEDY = SamplingSpec(temperature=0.0, logprobs=True, ignore_eos=True)


@dataclass(frozen=True)
class EngineCase:
    """What every rank (and the one-device reference) runs: JSON, so it crosses as a string."""

    model_dir: str
    adapters: dict[str, str]  # name -> PEFT directory
    prompts: list[list[int]]
    names: list[str | None]  # adapter per row, None = base model
    new_tokens: int
    page_tokens: int = 8
    extra: dict = field(default_factory=dict)  # see drive
    merged: str | None = None  # dLoRA merged mode: every row is of this adapter, folded into the weights
    load_groups: int = 2  # layer groups each placement loads in (a background copy on CPU)
    num_pages: int = 400
    cpu_assist: bool = False  # prefill adapter rows' early layers on rank 0's CPU workers (tests/tp_assist_support.py)

    def spec(self, world_size: int) -> EngineSpec:
        return EngineSpec(model=self.model_dir, device="cpu", dtype="float32", page_tokens=self.page_tokens,
                          num_pages=self.num_pages, max_lora_rank=128, tensor_parallel_size=world_size,
                          adapter_load_mode="cpu_assist" if self.cpu_assist else "auto")



def drive(case: EngineCase, run: Callable[[object], object], assist=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the adapters, prefill every row (placing the adapters in the same step), decode the rest;
    returns (tokens [rows, new_tokens], logprobs [rows, new_tokens]). extra["bad_adapter"]: a path whose
    load must fail first (on every rank alike: the engine goes on). assist: a tests/tp_assist_support.py
    AssistRig that runs the prefill's adapter rows on CPU workers for their first layers (extra["stalled_workers"]:
    planned, but no job sent, so rank 0's deadline falls back for the whole step)."""
    if "bad_adapter" in case.extra:
        reply = run(EngineLoadAdapter(name="bad", path=case.extra["bad_adapter"]))
        assert isinstance(reply, EngineFailure) and reply.code == "invalid_adapter", reply
    next_page = 0
    place = []
    for name, path in case.adapters.items():
        reply = run(EngineLoadAdapter(name=name, path=path))
        assert isinstance(reply, EngineAdapterLoaded), reply
        if assist is not None:
            assist.loaded[name] = reply
        place.append(AdapterPlacement(name, list(range(next_page, next_page + reply.num_pages)), case.load_groups))
        next_page += reply.num_pages
    pages = []
    for prompt in case.prompts:
        n = -(-(len(prompt) + case.new_tokens) // case.page_tokens)
        pages.append(list(range(next_page, next_page + n)))
        next_page += n
    assert next_page <= case.num_pages, f"the case needs {next_page} pages"
    k = case.extra.get("prompt_logprobs")  # the prefill also scores every prompt token (RowPlan.prompt_scored)
    first = GREEDY if k is None else dataclasses.replace(GREEDY, prompt_logprobs=k)
    rows = [RowPlan(f"r{i}", list(p), 0, pages[i], case.names[i], True, first,
                    prompt_scored=len(p) - 1 if k is not None else 0)
            for i, p in enumerate(case.prompts)]
    tokens, logprobs = [], []
    for step in range(case.new_tokens):
        cpu = None
        if assist is not None and step == 0:
            rows, cpu = assist.plan(rows, stalled=case.extra.get("stalled_workers", False))
        reply = run(EngineStep(plan=StepPlan(step, rows, place if step == 0 else [], cpu=cpu,
                                             merged_adapter=case.merged)))
        assert isinstance(reply, EngineStepDone), reply
        if cpu is not None:
            assist.finish_step()
            stalled = case.extra.get("stalled_workers", False)
            assert reply.result.cpu_timeouts == int(stalled), f"{reply.result.cpu_timeouts} CPU sites timed out"
            assert (reply.result.transfer_bytes["assist_h2d"] > 0) != stalled, "deltas from workers that ran none"
        if step == 0 and k is not None:  # each row's prompt logprobs, rows in order, one flat tensor
            chunks = {c.request_id: c.logprobs for c in reply.result.prompt_logprobs}
            case.extra["scored"] = [lp for r in rows for lp in chunks[r.request_id]]
        by_id = {r.request_id: r for r in reply.result.rows}
        sampled = [by_id[r.request_id] for r in rows]
        tokens.append([r.token_id for r in sampled])
        logprobs.append([r.logprob for r in sampled])
        rows = [RowPlan(r.request_id, [s.token_id], r.start_pos + len(r.token_ids), r.kv_pages, r.adapter, True,
                        GREEDY, step + 1) for r, s in zip(rows, sampled)]
    return torch.tensor(tokens).t().contiguous(), torch.tensor(logprobs, dtype=torch.float64).t().contiguous()


def single_device(case: EngineCase) -> tuple[torch.Tensor, torch.Tensor]:
    from loraplex.gpu_engine.engine_orders import EngineOrders
    from loraplex.gpu_engine.runtime import build_runtime

    orders = EngineOrders(build_runtime(case.spec(1)))
    try:
        return drive(case, orders.run)
    finally:
        orders.close()


def rank_main(rank: int, world_size: int, store_file: str, cases_json: str, out_dir: str) -> None:
    """One spawned rank: rank 0 drives the cases one after the other (the same model), the others
    serve what it shares."""
    from loraplex.gpu_engine.engine_orders import EngineOrders
    from loraplex.gpu_engine.runtime import build_runtime
    from loraplex.gpu_engine.tp.group import join, open_store
    from loraplex.gpu_engine.tp.worker import serve
    from loraplex.ipc.protocol import EngineShutdown

    cases = [EngineCase(**c) for c in json.loads(cases_json)]
    case = cases[0]
    link = join(rank, world_size, open_store(store_file, world_size), "cpu")
    runtime = build_runtime(case.spec(world_size), link=link)
    resources = assist = None
    if case.cpu_assist and rank == 0:  # rank 0 alone owns the exchange, the host store and the workers
        from loraplex.gpu_engine.engine_process import CpuAssistResources
        from tests.tp_assist_support import AssistRig

        resources = CpuAssistResources(runtime)
        assist = AssistRig(resources, runtime.config.num_layers)
    orders = EngineOrders(runtime, store=resources.store if resources is not None else None)
    try:
        if rank:
            serve(orders, link)
            return
        control = link.control

        def run(order):
            control.share(order)
            reply = orders.run(order)
            return orders.settle(order, reply, control.failures(isinstance(reply, EngineFailure)), 0, world_size)

        results = {}
        for i, one in enumerate(cases):
            link.comm.ledger.clear()
            results[f"tokens.{i}"], results[f"logprobs.{i}"] = drive(one, run, assist)
            for what, counts in (("bytes", link.comm.ledger.bytes), ("calls", link.comm.ledger.calls)):
                results |= {f"{what}.{i}.{tag}": torch.tensor(n) for tag, n in counts.items()}
            if "scored" in one.extra:
                results[f"scored.{i}"] = torch.tensor(one.extra["scored"], dtype=torch.float64)
        control.share(EngineShutdown())
        save_file(results, str(Path(out_dir) / "result.safetensors"))
    finally:
        orders.close()
        if assist is not None:
            assist.close()
        if resources is not None:
            resources.close()
        link.comm.close()


def spawn_engine(world_size: int, cases: list[EngineCase], out_dir: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every case on one group of `world_size` ranks; rank 0's (tokens, logprobs) of each."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    cases_json = json.dumps([asdict(c) for c in cases])
    store_file = str(out_dir / "rendezvous")
    mp.spawn(rank_main, args=(world_size, store_file, cases_json, str(out_dir)), nprocs=world_size, join=True)
    result = load_file(str(out_dir / "result.safetensors"))
    return [(result[f"tokens.{i}"], result[f"logprobs.{i}"]) for i in range(len(cases))]


def collectives(out_dir: Path, case: int, what: str = "bytes") -> dict[str, int]:
    """What rank 0's collectives carried ("bytes") or how many it made ("calls") in case `case` of the
    last spawn_engine into out_dir, by tag (base, lora, embed, lm_head, ...)."""
    from safetensors.torch import load_file

    prefix = f"{what}.{case}."
    return {k.removeprefix(prefix): int(v) for k, v in load_file(str(out_dir / "result.safetensors")).items()
            if k.startswith(prefix)}
