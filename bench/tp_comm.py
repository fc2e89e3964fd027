"""Bytes communicated per layer and token under tensor parallelism, by the base
model and by the LoRA part, with S-LoRA's partition against the naive one (each
LoRA output all-gathered whole).

Computed: from the partition code (loraplex.contracts.tensor_parallel) for
Llama-2-7B dimensions, every --tp size, LoRA ranks --ranks and target sets.
Measured: a tensor-parallel engine of N gloo ranks on CPU, started as `loraplex
serve` starts one (this process is rank 0), runs one prefill step of the random
demo model with one adapter on every row (all seven targets, each rank of
--ranks), the collectives counting what they carry; the per-token figures are checked
against the same formula at the demo's dimensions.

    .venv/bin/python bench/tp_comm.py --json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from loraplex.contracts.tensor_parallel import TensorParallelPlan

TARGETS = {
    "qv": ("q_proj", "v_proj"),
    "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
                 vocab_size=32000)
GOAL_SHARE = 0.10


def per_token(plan: TensorParallelPlan, targets: tuple[str, ...], rank: int) -> dict[str, int]:
    """Elements per layer and token: base, S-LoRA's LoRA, the naive LoRA, and what each rank sends
    with ring collectives (all-reduce 2(N-1)/N of the tensor, all-gather (N-1)/N)."""
    n = plan.world_size
    base = plan.base_comm_per_layer()
    slora = sum(plan.lora_comm(m, rank) for m in targets)
    gathered = sum(plan.lora_comm(m, rank) for m in targets if m not in ("o_proj", "down_proj"))
    reduced = slora - gathered
    return {"base": base, "lora_slora": slora, "lora_naive": sum(plan.naive_lora_comm(m) for m in targets),
            "base_ring_sent": base * 2 * (n - 1) // n,
            "lora_slora_ring_sent": (gathered * (n - 1) + reduced * 2 * (n - 1)) // n}


def computed(tps: list[int], ranks: list[int], bytes_per_elem: int) -> list[dict]:
    rows = []
    for n in tps:
        plan = TensorParallelPlan(world_size=n, **LLAMA2_7B)
        for target_set, targets in TARGETS.items():
            for r in ranks:
                e = per_token(plan, targets, r)
                rows.append({
                    "tp": n, "targets": target_set, "rank": r,
                    "base_bytes": e["base"] * bytes_per_elem,
                    "lora_slora_bytes": e["lora_slora"] * bytes_per_elem,
                    "lora_naive_bytes": e["lora_naive"] * bytes_per_elem,
                    "slora_share": round(e["lora_slora"] / e["base"], 4),
                    "naive_share": round(e["lora_naive"] / e["base"], 4),
                    "slora_ring_sent_share": round(e["lora_slora_ring_sent"] / e["base_ring_sent"], 4),
                })
    return rows


def _ledgers(tp_size: int, ranks: list[int], adapter_root: str) -> dict:
    """Start a tensor-parallel engine of `tp_size` ranks as `loraplex serve` does (this process is rank 0,
    gpu_engine/tp/group.py starts the others), load one all-target adapter per LoRA rank, and run one
    prefill step of three rows per adapter with the ledger cleared: what rank 0's collectives carried."""
    import torch

    from loraplex.contracts.engine_spec import EngineSpec
    from loraplex.gpu_engine.demo import ensure_demo_model
    from loraplex.gpu_engine.engine_orders import EngineOrders
    from loraplex.gpu_engine.runtime import build_runtime, resolve_spec
    from loraplex.gpu_engine.tp.group import RankGroup
    from loraplex.ipc.engine_plan import AdapterPlacement, RowPlan, SamplingSpec, StepPlan
    from loraplex.ipc.protocol import EngineAdapterLoaded, EngineFailure, EngineLoadAdapter, EngineStep, EngineStepDone

    spec = resolve_spec(EngineSpec(model=str(ensure_demo_model().model_dir), device="cpu", dtype="float32",
                                   page_tokens=8, num_pages=2048, max_lora_rank=max(ranks),
                                   tensor_parallel_size=tp_size, adapter_dirs=(adapter_root,)))
    group = RankGroup.start(spec, demo=False)
    orders = None
    try:
        runtime = build_runtime(spec, link=group.link)
        group.serving()
        orders = EngineOrders(runtime)

        def run(order):
            group.share(order)
            reply = orders.run(order)
            return orders.settle(order, reply, group.control.failures(isinstance(reply, EngineFailure)), 0, tp_size)

        ledger = group.link.comm.ledger
        gen = torch.Generator().manual_seed(0)
        lengths = [37, 64, 23]
        vocab = runtime.config.vocab_size
        greedy = SamplingSpec(temperature=0.0, ignore_eos=True)
        runs, next_page = [], 0
        for step, r in enumerate(ranks):
            name = f"all-r{r}"
            loaded = run(EngineLoadAdapter(name=name, path=str(Path(adapter_root) / name)))
            assert isinstance(loaded, EngineAdapterLoaded), loaded
            placement = AdapterPlacement(name, list(range(next_page, next_page + loaded.num_pages)))
            next_page += loaded.num_pages
            rows = []
            for i, n in enumerate(lengths):
                kv = -(-n // 8)
                rows.append(RowPlan(f"r{r}-{i}", torch.randint(3, vocab, (n,), generator=gen).tolist(), 0,
                                    list(range(next_page, next_page + kv)), name, True, greedy))
                next_page += kv
            ledger.clear()
            done = run(EngineStep(plan=StepPlan(step, rows, [placement])))
            assert isinstance(done, EngineStepDone), done
            runs.append({"rank": r, "tokens": sum(lengths), "samples": len(lengths),
                         "bytes": dict(ledger.bytes), "calls": dict(ledger.calls)})
        return {"layers": runtime.config.num_layers, "runs": runs}
    finally:
        if orders is not None:
            orders.close()
        group.close()


def measured(tp_size: int, ranks: list[int]) -> dict:
    from loraplex.gpu_engine.demo import demo_model_config, ensure_demo_model, write_random_adapter
    from loraplex.gpu_engine.model.config import ModelConfig

    cfg = ModelConfig.from_dir(ensure_demo_model().model_dir)
    plan = TensorParallelPlan.for_model(cfg, tp_size)
    with tempfile.TemporaryDirectory(prefix="tp-comm-") as tmp:
        for r in ranks:
            write_random_adapter(Path(tmp) / f"all-r{r}", demo_model_config(), rank=r, alpha=2.0 * r,
                                 target_modules=list(TARGETS["all"]), seed=r)
        print(f"measuring: a {tp_size}-rank engine (gloo), demo model, LoRA ranks {ranks}", file=sys.stderr)
        ledger = _ledgers(tp_size, ranks, tmp)
    rows = []
    layers = ledger["layers"]
    for run in ledger["runs"]:
        per = run["tokens"] * layers
        e = per_token(plan, TARGETS["all"], run["rank"])
        base = run["bytes"].get("base", 0) / per
        lora = run["bytes"].get("lora", 0) / per
        rows.append({"rank": run["rank"], "tokens": run["tokens"],
                     "base_bytes_per_layer_token": base, "lora_bytes_per_layer_token": lora,
                     "lora_share": round(lora / base, 4),
                     "formula_base_bytes": e["base"] * 4, "formula_lora_bytes": e["lora_slora"] * 4,
                     "matches_formula": base == e["base"] * 4 and lora == e["lora_slora"] * 4,
                     "collectives_per_layer": {k: v / layers for k, v in run["calls"].items()
                                               if k in ("base", "lora")}})
    return {"model": "demo (hidden 256, intermediate 704, 8 heads, 4 KV heads, 4 layers)", "tp": tp_size,
            "dtype": "float32", "targets": "all", "runs": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--bytes-per-elem", type=int, default=2, help="2: float16/bfloat16 activations")
    p.add_argument("--measure-tp", type=int, default=2, help="gloo ranks of the measured run (0: skip it)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if any(r <= 0 or r > 256 for r in args.ranks) or any(n < 1 or n > 64 for n in args.tp):
        p.error("ranks must lie in 1..256 and tp sizes in 1..64")
    rows = computed(args.tp, args.ranks, args.bytes_per_elem)
    worst = max(rows, key=lambda r: r["slora_share"])
    missed = {measure: [f"tp{r['tp']}/{r['targets']}/r{r['rank']}" for r in rows if r[measure] > GOAL_SHARE]
              for measure in ("slora_share", "slora_ring_sent_share")}
    result = {
        "benchmark": "tp_comm",
        "model": "Llama-2-7B dims (hidden 4096, intermediate 11008, 32 heads, 32 KV heads, vocab 32000)",
        "bytes_per_elem": args.bytes_per_elem,
        "unit": "bytes per layer per token (elements of each collective's result)",
        # outside the layers: the embedding all-reduce per token, the logits gather per sampled token
        "per_model_bytes": {str(n): {k: v * args.bytes_per_elem for k, v in
                                     TensorParallelPlan(world_size=n, **LLAMA2_7B).base_comm_per_model().items()}
                            for n in args.tp},
        "computed": rows,
        "goal": {"lora_share_max": GOAL_SHARE, "cases": len(rows),
                 "missed_by_payload": missed["slora_share"], "missed_by_ring_sent": missed["slora_ring_sent_share"],
                 "worst": {k: worst[k] for k in ("tp", "targets", "rank", "slora_share", "slora_ring_sent_share")}},
    }
    if args.measure_tp > 1:
        result["measured"] = measured(args.measure_tp, args.ranks)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'tp':>3} {'targets':>7} {'rank':>5} {'base B':>8} {'S-LoRA B':>9} {'naive B':>8} "
          f"{'S-LoRA %':>9} {'naive %':>8} {'ring %':>7}")
    for r in rows:
        print(f"{r['tp']:>3} {r['targets']:>7} {r['rank']:>5} {r['base_bytes']:>8} {r['lora_slora_bytes']:>9} "
              f"{r['lora_naive_bytes']:>8} {100 * r['slora_share']:>8.1f}% {100 * r['naive_share']:>7.1f}% "
              f"{100 * r['slora_ring_sent_share']:>6.1f}%")
    for m in result.get("measured", {}).get("runs", []):
        print(f"measured demo tp{args.measure_tp} r{m['rank']}: base {m['base_bytes_per_layer_token']} B, "
              f"LoRA {m['lora_bytes_per_layer_token']} B, matches formula: {m['matches_formula']}")


if __name__ == "__main__":
    main()
