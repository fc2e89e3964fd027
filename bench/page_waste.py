"""Unified-pool page waste for the demo model, Llama-2-7B and Llama-3-8B dims.

Reports page size, the share of an adapter's pages left empty per rank and target
set, and the KV waste of partly filled last pages, next to S-LoRA-style pages of
one row width. Pure arithmetic over `loraplex.contracts.geometry`: no weights.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.contracts.geometry import PageGeometry, adapter_waste, kv_waste, plan_adapter_layout
from loraplex.gpu_engine.demo import demo_model_config
from loraplex.gpu_engine.model.config import ModelConfig

RANKS = (8, 16, 32, 64, 128)
TARGET_SETS: dict[str, tuple[str, ...]] = {
    "qv": ("q_proj", "v_proj"),
    "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
UNIFORM_MAX_LEN = 4096
DTYPE_BYTES = {"float32": 4, "float16": 2}
# The traces live in the workspace's shared/ (beside the checkout, or inside it on some hosts).
_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES_DIR = next((d for d in (_ROOT / "shared" / "traces", _ROOT.parent / "shared" / "traces") if d.is_dir()),
                          _ROOT.parent / "shared" / "traces")
TRACES = {"azure_conv_2023": "AzureLLMInferenceTrace_conv.csv", "azure_code_2023": "AzureLLMInferenceTrace_code.csv"}


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    dtype: str
    config: ModelConfig


def llama_dims(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> ModelConfig:
    return ModelConfig.from_hf({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
    })


def models() -> list[Model]:
    return [
        Model("demo", "float32", ModelConfig.from_hf(demo_model_config())),
        Model("llama-2-7b", "float16", llama_dims(4096, 11008, 32, 32, 32, 32000)),
        Model("llama-3-8b", "float16", llama_dims(4096, 14336, 32, 32, 8, 128256)),
    ]


def kv_waste_stats(geometry: PageGeometry, lengths: list[int]) -> dict[str, float]:
    """mean: average per-sequence waste; aggregate: empty slots / allocated slots over all sequences."""
    pages = sum(geometry.kv_pages_for(n) for n in lengths)
    return {
        "mean": sum(kv_waste(geometry, n) for n in lengths) / len(lengths),
        "aggregate": 1.0 - sum(lengths) / (pages * geometry.page_tokens),
    }


def adapter_table(geometry: PageGeometry, shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for set_name, targets in TARGET_SETS.items():
        table[set_name] = {}
        for rank in RANKS:
            layout = plan_adapter_layout(geometry, shapes, targets, rank)
            table[set_name][str(rank)] = {"pages_per_layer": layout.num_pages,
                                          "waste": adapter_waste(geometry, layout)}
    return table


def row_pages(width: int, shapes: dict[str, tuple[int, int]], kv_dim: int) -> dict[str, Any]:
    """S-LoRA-style pool: a page is one vector of `width` elements; a wider vector takes whole extra pages.

    Adapter rows (A rows, in_features wide; B^T rows, out_features wide) and each token's K and V
    vectors (kv_dim wide, one token per page, so no partly filled last page) each round up on their own.
    """
    def slots(w: int) -> int:
        return -(-w // width)

    adapters: dict[str, dict[str, Any]] = {}
    for set_name, targets in TARGET_SETS.items():
        # Every rank has the same rows per rank unit, so the waste does not depend on rank.
        used = sum(sum(shapes[t]) for t in targets)
        pages = sum(slots(shapes[t][0]) + slots(shapes[t][1]) for t in targets)
        adapters[set_name] = {"pages_per_layer_per_rank": pages, "waste": 1.0 - used / (pages * width)}
    return {"page_elems": width, "adapter": adapters,
            "kv_waste_per_token": 1.0 - kv_dim / (slots(kv_dim) * width)}


def load_trace_lengths(path: Path) -> list[int]:
    """Final sequence length (context + generated tokens) of every request in an Azure LLM trace."""
    with path.open(newline="") as f:
        return [int(row["ContextTokens"]) + int(row["GeneratedTokens"]) for row in csv.DictReader(f)]


def model_report(model: Model, page_tokens: list[int | None],
                 distributions: dict[str, list[int]]) -> dict[str, Any]:
    cfg = model.config
    shapes = cfg.module_shapes()
    elem = DTYPE_BYTES[model.dtype]
    geometries: list[dict[str, Any]] = []
    for pt in page_tokens:
        try:
            geometry = PageGeometry.for_model(shapes, cfg.kv_dim, pt)
        except ValueError as exc:
            geometries.append({"page_tokens": pt, "error": str(exc)})
            continue
        geometries.append({
            "page_tokens": geometry.page_tokens,
            "default": pt is None,
            "page_elems": geometry.page_elems,
            "page_bytes_per_layer": geometry.page_elems * elem,
            "page_bytes_all_layers": geometry.page_elems * elem * cfg.num_layers,
            "adapter": adapter_table(geometry, shapes),
            "kv": {name: kv_waste_stats(geometry, lengths) for name, lengths in distributions.items()},
        })
    widths = sorted({cfg.hidden_size, cfg.kv_dim}, reverse=True)
    return {
        "name": model.name,
        "dtype": model.dtype,
        "dims": {"hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "layers": cfg.num_layers,
                 "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                 "kv_dim": cfg.kv_dim, "vocab": cfg.vocab_size},
        "geometries": geometries,
        "row_pages": [row_pages(w, shapes, cfg.kv_dim) for w in widths],
    }


def print_tables(report: dict[str, Any]) -> None:
    for m in report["models"]:
        print(f"\n== {m['name']} ({m['dtype']}) kv_dim {m['dims']['kv_dim']} hidden {m['dims']['hidden']}")
        for g in m["geometries"]:
            if "error" in g:
                print(f"page_tokens {g['page_tokens']}: {g['error']}")
                continue
            print(f"page_tokens {g['page_tokens']}{' (default)' if g['default'] else ''}: "
                  f"{g['page_elems']} elems, {g['page_bytes_per_layer']} B/layer, "
                  f"{g['page_bytes_all_layers']} B over all layers")
            print("  adapter waste   " + " ".join(f"r{r:>5}" for r in RANKS))
            for set_name, by_rank in g["adapter"].items():
                print(f"  {set_name:<15} " + " ".join(f"{by_rank[str(r)]['waste']:>6.2%}" for r in RANKS))
            for name, kv in g["kv"].items():
                print(f"  kv {name:<20} mean {kv['mean']:.2%}  aggregate {kv['aggregate']:.2%}")
        for rp in m["row_pages"]:
            wastes = ", ".join(f"{k} {v['waste']:.2%}" for k, v in rp["adapter"].items())
            print(f"row pages of {rp['page_elems']} elems: adapter {wastes}; "
                  f"kv per token {rp['kv_waste_per_token']:.2%}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page-tokens", type=int, nargs="*", default=[],
                   help="page_tokens to report besides the for_model default")
    p.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES_DIR,
                   help="directory of the Azure LLM inference traces (skipped when absent)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = p.parse_args(argv)
    if any(pt < 1 for pt in args.page_tokens):
        p.error("--page-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    distributions: dict[str, list[int]] = {"uniform_1_4096": list(range(1, UNIFORM_MAX_LEN + 1))}
    for name, filename in TRACES.items():
        path = args.traces_dir / filename
        if path.is_file():
            distributions[name] = load_trace_lengths(path)
        else:
            print(f"page_waste: no trace at {path}; skipping {name}", file=sys.stderr)
    page_tokens: list[int | None] = [None, *dict.fromkeys(args.page_tokens)]
    report = {
        "benchmark": "page_waste",
        "ranks": list(RANKS),
        "target_sets": {k: list(v) for k, v in TARGET_SETS.items()},
        "kv_distributions": {
            name: {"sequences": len(lengths), "mean_len": sum(lengths) / len(lengths),
                   "source": "lengths 1..4096, each once" if name.startswith("uniform")
                   else f"{TRACES[name]}: ContextTokens + GeneratedTokens per request"}
            for name, lengths in distributions.items()
        },
        "models": [model_report(m, page_tokens, distributions) for m in models()],
    }
    if args.json:
        print(json.dumps(report, allow_nan=False))
    else:
        print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
