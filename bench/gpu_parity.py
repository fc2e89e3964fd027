"""Parity checks of the CUDA paths, each against its reference, on fresh random inputs:

- `kernels`: BGMV, MBGMV and SGMV/MBGMM (shrink + expand) at real size (hidden
  4096, fused q/k/v widths, batch 64, mixed ranks 8-128, base rows) in float16
  and bfloat16 against the float32 torch references;
- `attention`: the paged prefill and flash-decoding kernels at real size
  (Llama-, Mistral- and Gemma-2-shaped heads: GQA, head_dim 128 and 256, a
  sliding window shorter than the contexts, tanh soft-capped logits, a
  non-default q·k scale; 4k-token contexts over shuffled pages) in float16 and
  bfloat16 against the float32 torch reference;
- `graphs`: decode replayed as CUDA graphs against eager decode (identical
  greedy tokens, float32 with the Triton backend);
- `peft_offline`: the offline `LLM` against transformers + PEFT (the random demo
  model with every demo adapter, one mixed batch, float32);
- `daemon`: a live daemon in on_demand mode against transformers + PEFT, and one
  in cpu_assist mode against the on_demand tokens (cold adapters, float32);
- `families`: every other served family's random demo (Qwen3, Gemma 1/2/3, Phi,
  Phi-3, GPT-2: q/k norms, soft-caps, head_dim 256 where the demo has it, fused
  modules, learned positions) with its demo adapters, and an adapter with LoRA
  on embed_tokens and lm_head, each against transformers + PEFT (float32).

`--device cpu --small` runs what can run on a CPU at toy size (kernels under the
Triton interpreter); CUDA-only checks come back skipped with their reason. One
JSON object on stdout (`--json`), progress on stderr; exit 1 if a check failed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

CHECKS = ("kernels", "attention", "graphs", "peft_offline", "daemon", "families")
ROW_ADAPTERS = [None, "qv-r8", "attn-r16", "all-r32", "mlp-r64", None, "rslora-r16", "kdown-r8"]
NEW_TOKENS = 16
RANKS = [8, 16, 32, 64, 128]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def lora_case(batch: int, *, device: str, dtype, hidden: int = 4096, seed: int | None = None,
              ranks: list[int] = RANKS):
    """x [batch, hidden], a flat weight pool of hidden-wide rows, every row at a shuffled place, and
    the tables of three fused modules (q, k, v) with mixed ranks cycling over `ranks`."""
    import torch

    from loraplex.kernels.lora_tables import build_tables

    g = torch.Generator().manual_seed(batch if seed is None else seed)
    row_ranks = [ranks[i % len(ranks)] for i in range(batch)]
    total = 2 * 3 * sum(row_ranks)
    order = torch.randperm(total, generator=g).tolist()
    flat = (torch.randn(total * hidden, generator=g) * 0.05).to(device, dtype)
    cells = [[([order.pop() * hidden for _ in range(r)], [order.pop() * hidden for _ in range(r)]) for r in row_ranks]
             for _ in range(3)]
    tables = build_tables(cells, [0.5] * batch, device)
    x = torch.randn(batch, hidden, generator=g).to(device, dtype)
    return x, flat, tables


def _max_err(got, want) -> float:
    return float((got.float() - want).abs().max())


def check_kernels(device: str, small: bool) -> dict[str, Any]:
    import torch

    from loraplex.kernels import lora_bgmv, lora_mbgmv, lora_sgmv

    hidden, kv, batch, seg = (64, 16, 6, 3) if small else (4096, 1024, 64, 100)
    dtypes = [torch.float32] if device == "cpu" else [torch.float16, torch.bfloat16]
    tol = 1e-4 if device == "cpu" else 2e-2
    errors: dict[str, float] = {}
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        seed = int(torch.randint(1 << 30, ()))  # fresh inputs every run; the seed is reported
        x, flat, tables = lora_case(batch, device=device, dtype=dtype, hidden=hidden, seed=seed)
        slot = torch.arange(batch, dtype=torch.int32, device=device)
        slot[::7] = -1  # base rows
        for kind, mod in (("bgmv", lora_bgmv), ("mbgmv", lora_mbgmv)):
            outs = [torch.randn(batch, n, device=device).to(dtype) for n in (hidden, kv, kv)]
            want = [o.float() for o in outs]
            lora_bgmv.bgmv_reference(want, x.float(), flat.float(), slot, tables)
            y = getattr(mod, f"{kind}_shrink")(x, flat, slot, tables)
            getattr(mod, f"{kind}_expand")(outs, y, flat, slot, tables)
            errors[f"{kind}_{name}"] = max(_max_err(o, w) for o, w in zip(outs, want))
        segments = min(5, batch)
        xs = x[:segments].repeat_interleave(seg, 0)  # segments of `seg` tokens, ranks 8..128
        i32 = dict(dtype=torch.int32, device=device)
        start, length = torch.arange(segments, **i32) * seg, torch.full((segments,), seg, **i32)
        sslot = torch.arange(segments, **i32)
        outs = [torch.randn(segments * seg, n, device=device).to(dtype) for n in (hidden, kv, kv)]
        want = [o.float() for o in outs]
        lora_sgmv.sgmv_reference(want, xs.float(), flat.float(), start, length, sslot, tables)
        y = lora_sgmv.sgmv_shrink(xs, flat, start, length, sslot, tables, seg)
        lora_sgmv.sgmv_expand(outs, y, flat, start, length, sslot, tables, seg)
        errors[f"sgmv_{name}"] = max(_max_err(o, w) for o, w in zip(outs, want))
        errors[f"seed_{name}"] = seed
    worst = max(v for k, v in errors.items() if not k.startswith("seed_"))
    return {"ok": worst <= tol, "max_abs_err": errors, "tolerance": tol, "hidden": hidden, "batch": batch,
            "ranks": RANKS if not small else "cycled"}


# (name, heads, kv heads, head_dim, window, q·k scale over head_dim ** -0.5, softcap); the cap is set
# low enough to bend random logits (Gemma 2's 50 takes the same code path)
ATTENTION_SHAPES = [("llama", 32, 8, 128, None, 1.0, None), ("mistral_window", 32, 8, 128, 1024, 1.0, None),
                    ("gemma2_sliding", 16, 8, 256, 1024, 1.3, 2.0), ("gemma2_global", 16, 8, 256, None, 1.3, 2.0)]


def check_attention(device: str, small: bool) -> dict[str, Any]:
    import torch

    from loraplex.kernels.paged_attention_decode import paged_decode_attention
    from loraplex.kernels.paged_attention_prefill import paged_prefill_attention
    from loraplex.kernels.paged_kv import build_rows, paged_attention_reference

    page_tokens = 16
    # decode rows (contexts), prefill rows (q_len, start_pos): chunks continuing past the window too
    decode_ctx, prefill = ((1, 9, 37, 70), [(20, 0), (13, 40)]) if small else \
        ((1, 300, 1024, 1025, 2900, 4096, 4097, 5000), [(512, 0), (512, 2048), (300, 3800), (1, 700)])
    shapes = [(n, 4, 2, d, w and (8 if small else w), sc, cap) for n, _, _, d, w, sc, cap in ATTENTION_SHAPES] \
        if small else ATTENTION_SHAPES
    dtypes = [torch.float32] if device == "cpu" else [torch.float16, torch.bfloat16]
    tol = 1e-4 if device == "cpu" else 2e-2
    errors: dict[str, Any] = {}
    for (name, heads, kv_heads, head_dim, window, scale_x, cap), dtype in itertools.product(shapes, dtypes):
        seed = int(torch.randint(1 << 30, ()))  # fresh inputs every run; the seed is reported
        g = torch.Generator().manual_seed(seed)
        scale = scale_x * head_dim ** -0.5
        rows_of = {"decode": [(1, c - 1) for c in decode_ctx], "prefill": prefill}
        pages = sum(-(-(c + s) // page_tokens) for rows in rows_of.values() for c, s in rows)
        kv = torch.randn(pages + 3, page_tokens * 2 * kv_heads * head_dim, generator=g).to(device, dtype)
        free = torch.randperm(pages + 3, generator=g).tolist()  # every row's pages shuffled over the pool
        for kind, row_list in rows_of.items():
            spans, first = [], 0
            for count, start in row_list:
                spans.append((first, count, start, [free.pop() for _ in range(-(-(count + start) // page_tokens))]))
                first += count
            rows = build_rows(spans, device)
            q = torch.randn(first, heads, head_dim, generator=g).to(device, dtype)
            common = dict(num_kv_heads=kv_heads, page_tokens=page_tokens, window=window, scale=scale, softcap=cap)
            got = (paged_decode_attention if kind == "decode" else paged_prefill_attention)(q, kv, rows, **common)
            want = paged_attention_reference(q.float(), kv.float(), rows, kv_heads, page_tokens, window, scale, cap)
            errors[f"{name}_{kind}_{str(dtype).replace('torch.', '')}"] = _max_err(got, want)
        errors[f"seed_{name}_{str(dtype).replace('torch.', '')}"] = seed
    worst = max(v for k, v in errors.items() if not k.startswith("seed_"))
    return {"ok": worst <= tol, "max_abs_err": errors, "tolerance": tol, "page_tokens": page_tokens,
            "decode_contexts": list(decode_ctx), "prefill_rows": prefill,
            "shapes": [dict(zip(("name", "heads", "kv_heads", "head_dim", "window", "scale_x", "softcap"), s))
                       for s in shapes]}


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(5, 60, (n,), generator=g)]


def _demo():
    os.environ.setdefault("LORAPLEX_DEMO", "random")  # the parity fixture the tests use
    from loraplex.gpu_engine.demo import ensure_demo_model

    return ensure_demo_model()


def _llm(demo, device: str, **kw):
    from loraplex import LLM

    llm = LLM(demo.model_dir, device=device, num_pages=512, max_num_seqs=16, **kw)
    for name, path in demo.adapters.items():
        llm.add_adapter(name, path)
    return llm


def check_graphs(device: str, small: bool) -> dict[str, Any]:
    if not device.startswith("cuda"):
        return {"skipped": "CUDA graphs need a CUDA device"}
    from loraplex import SamplingParams

    demo = _demo()
    prompts = _prompts(512, len(ROW_ADAPTERS), int(time.time()))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, replays, info = {}, 0, {}
    for graphs in (False, True):
        llm = _llm(demo, device, dtype="float32", lora_backend="triton", cuda_graphs=graphs)
        tokens[graphs] = [o.token_ids for o in llm.generate(prompts, adapters=ROW_ADAPTERS, sampling=params)]
        if graphs:
            replays = getattr(llm.executor.graphs, "replays", 0)  # no runner when capture was refused
            info = llm.executor.graph_info.as_dict()
    same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
    return {"ok": same == len(prompts) and replays > 0, "rows_identical": same, "rows": len(prompts),
            "graph_replays": replays, **info}


def _reference(demo, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    from tests.hf_reference import greedy

    adapters = dict(demo.adapters)
    return [greedy(demo.model_dir, adapters.get(n), p, NEW_TOKENS)[0] for p, n in zip(prompts, names)]


def check_peft_offline(device: str, small: bool) -> dict[str, Any]:
    from loraplex import SamplingParams

    demo = _demo()
    prompts = _prompts(512, len(ROW_ADAPTERS), int(time.time()))
    backend = "triton" if device.startswith("cuda") else "torch"
    llm = _llm(demo, device, dtype="float32", lora_backend=backend)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, adapters=ROW_ADAPTERS, sampling=params)]
    want = _reference(demo, prompts, ROW_ADAPTERS)
    same = sum(a == b for a, b in zip(got, want))
    return {"ok": same == len(prompts), "rows_identical": same, "rows": len(prompts), "backend": backend}


def _daemon_tokens(demo, device: str, mode: str, prompts, names, root: Path) -> tuple[list[list[int]], list[str]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from soak import start_daemon, stop_daemon

    from loraplex.ipc.client import Client

    serve = ["--model", str(demo.model_dir), "--device", device, "--dtype", "float32", "--num-pages", "512",
             "--adapter-load-mode", mode, "--cpu-workers", "2"]
    for name, path in demo.adapters.items():
        serve += ["--adapter", f"{name}={path}"]
    (root / mode).mkdir()
    proc, runtime_dir = start_daemon(root / mode, serve)
    try:
        with Client(runtime_dir=runtime_dir) as client:
            results = [client.generate(p, n, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, timeout=300)
                       for p, n in zip(prompts, names)]
    finally:
        code = stop_daemon(proc)
    if code != 0:
        raise RuntimeError(f"the {mode} daemon exited with {code}")
    return [r.token_ids for r in results], [str(r.timings.get("adapter_path")) for r in results]


def check_daemon(device: str, small: bool) -> dict[str, Any]:
    demo = _demo()
    names = ROW_ADAPTERS[:4] if small else ROW_ADAPTERS  # small: base and three adapters of ranks 8-32
    prompts = _prompts(512, len(names), int(time.time()))
    with tempfile.TemporaryDirectory(prefix="lpx-parity-") as tmp:
        on_demand, _ = _daemon_tokens(demo, device, "on_demand", prompts, names, Path(tmp))
        assisted, paths = _daemon_tokens(demo, device, "cpu_assist", prompts, names, Path(tmp))
    want = _reference(demo, prompts, names)
    vs_peft = sum(a == b for a, b in zip(on_demand, want))
    vs_on_demand = sum(a == b for a, b in zip(assisted, on_demand))
    return {"ok": vs_peft == len(prompts) and vs_on_demand == len(prompts), "rows": len(prompts),
            "on_demand_rows_equal_peft": vs_peft, "cpu_assist_rows_equal_on_demand": vs_on_demand,
            "cpu_assisted_rows": paths.count("cpu_assisted"), "adapter_paths": paths}


def _head_adapter(model_dir: Path, dest: Path) -> Path:
    """A peft adapter with LoRA on embed_tokens, lm_head and q/v (random A and B), saved at `dest`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "embed_tokens", "lm_head"])
    adapted = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for key, p in adapted.named_parameters():
            if "lora_embedding" in key:
                p.mul_(0.2)  # peft draws both embedding factors from N(0, 1)
    adapted.save_pretrained(dest)
    return dest


def check_families(device: str, small: bool) -> dict[str, Any]:
    from loraplex import SamplingParams
    from loraplex.contracts.demo import DEMO_FAMILIES
    from loraplex.gpu_engine.demo import ensure_demo_model
    from tests.hf_reference import greedy

    # small (the CPU dry run, which keeps this harness from rotting): one family with fused projections;
    # tests/test_architectures.py holds every family to PEFT on CPU
    families = ["phi3"] if small else [f for f in DEMO_FAMILIES if f != "llama"]
    backend = "triton" if device.startswith("cuda") else "torch"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lpx-families-") as tmp:
        for family in ["llama-heads", *families]:
            demo = ensure_demo_model(Path(tmp) / family, family=family.removesuffix("-heads"))
            llm = _llm(demo, device, dtype="float32", lora_backend=backend)
            names = list(ROW_ADAPTERS[:4] if small else ROW_ADAPTERS)
            adapters = dict(demo.adapters)
            if family == "llama-heads":
                adapters["heads-r8"] = _head_adapter(demo.model_dir, Path(tmp) / "heads-r8")
                llm.add_adapter("heads-r8", adapters["heads-r8"])
                names = [None, "heads-r8", "qv-r8", "heads-r8"]
            prompts = _prompts(llm.config.vocab_size, len(names), int(time.time()))
            got = [o.token_ids for o in llm.generate(prompts, adapters=names, sampling=params)]
            want = [greedy(demo.model_dir, adapters.get(n), p, NEW_TOKENS)[0] for p, n in zip(prompts, names)]
            out[family] = sum(a == b for a, b in zip(got, want))
            log(f"parity: families: {family} {out[family]}/{len(names)} rows equal")
            del llm
    rows = 4 if small else len(ROW_ADAPTERS)
    return {"ok": all(n == (4 if f == "llama-heads" else rows) for f, n in out.items()), "rows_identical": out,
            "backend": backend}


RUNNERS: dict[str, Callable[[str, bool], dict[str, Any]]] = {
    "kernels": check_kernels, "attention": check_attention, "graphs": check_graphs, "peft_offline": check_peft_offline,
    "daemon": check_daemon, "families": check_families}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset of " + ",".join(CHECKS))
    p.add_argument("--small", action="store_true", help="toy sizes (the CPU dry run)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.hf_reference
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report: dict[str, Any] = {"benchmark": "gpu_parity", "device": device, "checks": {}}
    for name in [c for c in args.checks.split(",") if c]:
        log(f"parity: {name} on {device}")
        started = time.monotonic()
        try:
            with torch.no_grad():
                result = RUNNERS[name](device, args.small)
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, the others still run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        result["seconds"] = round(time.monotonic() - started, 2)
        report["checks"][name] = result
        log(f"parity: {name}: {'skipped: ' + result['skipped'] if 'skipped' in result else result.get('ok')}")
    report["ok"] = all(r.get("ok", True) for r in report["checks"].values())
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
