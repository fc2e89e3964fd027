"""transformers + PEFT as a peer of bench/peers.py: the baseline S-LoRA and dLoRA report against.

It has no server, so this replays the workload in its own (pinned) process the way a simple
server built on it would: at each moment, the requests that have arrived (up to --max-batch, in
arrival order) run as one mixed-adapter batch (PEFT's `adapter_names`, "__base__" for the base
model) through a greedy loop with the KV cache until every row has its tokens; the next batch
starts when this one ends. Prompts of one workload share their length, so no padding. Each
request's end is timed from its arrival; its first token is not observable batch-wise, so TTFT
is reported as the end of its batch's first step.

Texts are decoded with special tokens skipped, as the servers stream them.

    python bench/peer_peft.py --model DIR --adapters adapters.json --workload workload.json --out results.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch


def load(model_dir: Path, adapters: dict[str, str]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if not adapters:
        return model.eval()
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def run_batch(model, batch: list[dict], with_adapters: bool) -> tuple[list[list[int]], list[list[float]], float]:
    """Greedy tokens of each row (no EOS stop: the servers run with ignore_eos), the margin of each
    token over the runner-up logit (a small margin is a near-tie another float order may flip),
    and the time of the first step's end."""
    ids = torch.tensor([r["prompt"] for r in batch])
    steps = max(r["max_tokens"] for r in batch)
    kwargs = {"adapter_names": [r["adapter"] or BASE for r in batch]} if with_adapters else {}
    out_tokens: list[list[int]] = [[] for _ in batch]
    margins: list[list[float]] = [[] for _ in batch]
    first = 0.0
    with torch.no_grad():
        past, step_input = None, ids
        for step in range(steps):
            out = model(input_ids=step_input, past_key_values=past, use_cache=True, **kwargs)
            past = out.past_key_values
            top2 = out.logits[:, -1].float().topk(2, dim=-1)
            nxt = top2.indices[:, 0]
            gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
            for i, t in enumerate(nxt.tolist()):
                if len(out_tokens[i]) < batch[i]["max_tokens"]:
                    out_tokens[i].append(t)
                    margins[i].append(gaps[i])
            if step == 0:
                first = time.perf_counter()
            step_input = nxt[:, None]
    return out_tokens, margins, first


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--adapters", type=Path, required=True, help="JSON: adapter name -> directory")
    p.add_argument("--workload", type=Path, required=True, help="JSON: the requests (bench/peer_workload.py)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    adapters = json.loads(args.adapters.read_text())
    requests = json.loads(args.workload.read_text())
    from tokenizers import Tokenizer

    tok_path = args.model / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
    model = load(args.model, adapters)
    with_adapters = bool(adapters)
    run_batch(model, [{**r, "max_tokens": 2} for r in requests[:8]], with_adapters)  # warm-up, as the servers get
    results, pending = [], sorted(requests, key=lambda r: r["arrival_s"])
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if pending[0]["arrival_s"] > now:
            time.sleep(pending[0]["arrival_s"] - now)
            continue
        batch = [r for r in pending if r["arrival_s"] <= now][: args.max_batch]
        pending = [r for r in pending if r not in batch]
        tokens, margins, first = run_batch(model, batch, with_adapters)
        end = time.perf_counter()
        for r, toks, gaps in zip(batch, tokens, margins):
            arrived = start + r["arrival_s"]
            results.append({"index": r["index"], "ok": True, "ttft_s": first - arrived, "e2e_s": end - arrived,
                            "tokens": len(toks), "token_ids": toks, "margins": gaps,
                            "text": tokenizer.decode(toks, skip_special_tokens=True) if tokenizer else ""})
        print(f"peft: {len(results)}/{len(requests)} done", file=sys.stderr)
    elapsed = time.perf_counter() - start
    args.out.write_text(json.dumps({"elapsed_s": elapsed, "results": results,
                                    "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
