"""Public adapter census (issue 32): of real public PEFT LoRA configs for decoder-only LLMs,
how many loraplex serves with output equal to transformers + PEFT.

The sample is bench/data/adapter_census.json (configs only; its header says how it was
collected). For each adapter of a causal decoder-only LLM:
1. a tiny random base of the same model_type is built with transformers' own config class
   (hidden 64, 4 layers, 4 heads, 2 KV heads where the family has GQA, vocab 512, head_dim 16),
   keeping the base's features the adapter meets (tied embeddings, sliding windows, RoPE scaling,
   Gemma's soft-caps and interleaved layers); one base per family and features, cached;
2. the adapter is built with peft from the sampled config (every LoraConfig field it sets; r above
   64 scaled to 64 keeping alpha/r; layer indices past the tiny base folded onto its layers; random
   B), and saved in the format the repository ships (.bin when only adapter_model.bin is there);
3. transformers + PEFT give the greedy tokens and chosen-token logprobs (the oracle,
   tests/hf_reference.py); loraplex's offline API serves the same prompt.

Each row ends as served_equal, mismatch, refused (loraplex's error, first line),
unsupported_base (loraplex refuses the base; counts as refused), serve_error / timeout (counted
as not served), or reference_failed (transformers or peft cannot build it: outside the
denominator, counted apart). Every case runs in a worker process under a per-case timeout, so
one failing adapter never stops the run. Progress on stderr; --json prints one JSON object and
writes bench/results/adapter_census.json.

    .venv/bin/python bench/adapter_census.py --json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "bench" / "data" / "adapter_census.json"
RESULTS = ROOT / "bench" / "results" / "adapter_census.json"

NEW_TOKENS = 12
PROMPT_LEN = 24  # longer than the stand-ins' 16-token sliding windows
LOGPROB_TOL = 1e-3
MAX_RANK = 64
TINY_LAYERS = 4
SLIDING = 16
CASE_TIMEOUT_S = 180.0
NOT_SERVED = ("mismatch", "refused", "unsupported_base", "serve_error", "timeout")

# Sampled config fields not passed to LoraConfig: where the base lives, bookkeeping, and the
# initialisation schemes (the census draws its own random weights).
_DROPPED = {"base_model_name_or_path", "revision", "auto_mapping", "peft_version", "init_lora_weights",
            "loftq_config", "eva_config", "corda_config", "lora_ga_config", "velora_config", "monteclora_config",
            "arrow_config", "kasa_config", "runtime_config", "megatron_config", "megatron_core"}
# model_types whose stand-in is the language model alone (the multimodal wrapper's vision and audio
# towers are of no use to the adapters sampled, which target the language model).
_TEXT_STAND_IN = {"gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text"}


# ---- the tiny stand-in bases ------------------------------------------------------------------------
def _rope_kwargs(spec: Any, head_dim: int) -> dict[str, Any]:
    if spec == "longrope":  # Phi-3.5: per-frequency factors past an original context
        half = head_dim // 2
        return {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0 + 0.25 * i for i in range(half)],
                                 "short_factor": [1.0 + 0.05 * i for i in range(half)]},
                "original_max_position_embeddings": 64}
    if isinstance(spec, dict):  # Llama 3.1 / 3.2's llama3 scaling, over a 64-token original context
        return {"rope_scaling": {**spec, "original_max_position_embeddings": 64}}
    return {}


def tiny_config(model_type: str, features: dict[str, Any]):
    """A transformers config of `model_type` at the census's tiny size, with `features` kept."""
    from transformers import AutoConfig

    llama_like = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the real ids (Phi-3's 32000) are past 512
    tie = features.get("tie_word_embeddings")
    extra: dict[str, Any] = {} if tie is None else {"tie_word_embeddings": tie}
    extra.update(_rope_kwargs(features.get("rope_scaling"), 16))
    if features.get("sliding_window"):
        extra["sliding_window"] = SLIDING
    if model_type in ("llama", "mistral", "qwen2", "qwen3", "hunyuan_v1_dense", "exaone4", "glm4"):
        return AutoConfig.for_model(model_type, **llama_like, **extra)
    if model_type == "phi3":  # Phi-3 has no GQA
        return AutoConfig.for_model(model_type, **{**llama_like, "num_key_value_heads": 4}, **extra)
    if model_type in ("gemma", "gemma2"):
        window = {"sliding_window": SLIDING} if model_type == "gemma2" else {}
        return AutoConfig.for_model(model_type, **llama_like, **window, **extra)
    if model_type in ("gemma3_text", "gemma4_text"):
        layers = ["sliding_attention"] * (TINY_LAYERS - 1) + ["full_attention"]
        return AutoConfig.for_model(model_type, **llama_like, sliding_window=SLIDING, layer_types=layers, **extra)
    if model_type == "gemma3":  # the multimodal checkpoint: a tiny SigLIP tower beside the language model
        layers = ["sliding_attention"] * (TINY_LAYERS - 1) + ["full_attention"]
        text = dict(llama_like, model_type="gemma3_text", sliding_window=SLIDING, layer_types=layers)
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=511, boi_token_index=509, eoi_token_index=510)
    if model_type == "qwen3_5_text":
        return AutoConfig.for_model(model_type, **llama_like,
                                    layer_types=["linear_attention"] * (TINY_LAYERS - 1) + ["full_attention"])
    if model_type == "phi":
        return AutoConfig.for_model("phi", hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
                                    num_attention_heads=4, vocab_size=512, max_position_embeddings=256, **extra)
    if model_type == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=64, n_inner=128, n_layer=TINY_LAYERS, n_head=4, vocab_size=512,
                                    n_positions=256)
    if model_type == "gpt_neox":
        return AutoConfig.for_model("gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
                                    num_attention_heads=4, vocab_size=512, max_position_embeddings=256)
    if model_type == "falcon":  # Falcon-7B: multi-query attention, parallel attention and MLP
        return AutoConfig.for_model("falcon", hidden_size=64, num_hidden_layers=TINY_LAYERS, num_attention_heads=4,
                                    vocab_size=512, max_position_embeddings=256)
    if model_type == "codegen":
        return AutoConfig.for_model("codegen", n_embd=64, n_inner=128, n_layer=TINY_LAYERS, n_head=4, rotary_dim=8,
                                    vocab_size=512, n_positions=256, n_ctx=256)
    if model_type == "nemotron_h":
        return AutoConfig.for_model("nemotron_h", hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                    hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16,
                                    ssm_state_size=16, n_groups=1, max_position_embeddings=256)
    # remote-code families (chatglm, internlm, baichuan, openelm) land here: transformers has no class
    return AutoConfig.for_model(model_type)


def family_key(row: dict[str, Any]) -> str:
    stand_in = _TEXT_STAND_IN.get(row["model_type"], row["model_type"])
    return stand_in + ("" if not row["features"] else "-" + json.dumps(row["features"], sort_keys=True))


def tiny_base(cache: Path, row: dict[str, Any]) -> Path:
    """The stand-in base for `row` (built once per family and features under `cache`)."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    key = family_key(row)
    out = cache / ("base-" + hashlib.sha1(key.encode()).hexdigest()[:12])
    if (out / "config.json").is_file():
        return out
    config = tiny_config(_TEXT_STAND_IN.get(row["model_type"], row["model_type"]), row["features"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma's 1 + w): random ones exercise the weights read
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


# ---- the adapter ----------------------------------------------------------------------------------
def _fold_layers(value: Any, layers: int) -> Any:
    if isinstance(value, int):
        return value % layers
    if isinstance(value, list):
        return sorted({int(v) % layers for v in value})
    return value


def lora_kwargs(config: dict[str, Any], layers: int) -> tuple[dict[str, Any], list[str]]:
    """LoraConfig arguments from a sampled config, and notes on what was changed."""
    import dataclasses

    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    notes: list[str] = []
    unknown = sorted(k for k in config if k not in known)
    if unknown:
        notes.append(f"fields peft {_peft_version()} does not know dropped: {', '.join(unknown)}")
    kw = {k: v for k, v in config.items() if k in known and k not in _DROPPED}
    kw["peft_type"] = "LORA"
    r = int(kw.get("r", 8))
    alpha = float(kw.get("lora_alpha", 8))
    if r > MAX_RANK:
        scale = (MAX_RANK / r) ** (0.5 if kw.get("use_rslora") else 1.0)
        notes.append(f"r {r} -> {MAX_RANK}, lora_alpha {alpha:g} -> {alpha * scale:g}")
        kw["r"], kw["lora_alpha"] = MAX_RANK, alpha * scale
    ltt = kw.get("layers_to_transform")
    if ltt is not None and _fold_layers(ltt, layers) != ltt:
        notes.append(f"layers_to_transform {ltt} -> {_fold_layers(ltt, layers)} (tiny base has {layers} layers)")
        kw["layers_to_transform"] = _fold_layers(ltt, layers)
    targets = kw.get("target_modules")
    if isinstance(targets, list):  # full paths naming a layer past the tiny base's
        folded = [re.sub(r"(layers|h)\.(\d+)\.", lambda m: f"{m.group(1)}.{int(m.group(2)) % layers}.", t)
                  for t in targets]
        if folded != targets:
            notes.append(f"layer indices in target_modules folded onto {layers} layers")
            kw["target_modules"] = sorted(set(folded))
    kw["init_lora_weights"] = False  # random B: an adapter that changes the output
    kw["lora_dropout"] = 0.0
    return kw, notes


def _peft_version() -> str:
    import peft

    return peft.__version__


def build_adapter(base_dir: Path, row: dict[str, Any], out: Path, seed: int) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    layers = base.config.get_text_config().num_hidden_layers
    kw, notes = lora_kwargs(row["config"], layers)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**kw))
    with torch.no_grad():  # modules_to_save copies start equal to the base: make them differ
        for name, p in model.named_parameters():
            if ".modules_to_save." in name or ".trainable_tokens_delta" in name:
                p.add_(0.05 * torch.randn_like(p))
    bin_only = row["weights"] == "bin"
    model.save_pretrained(out, safe_serialization=not bin_only)
    if row["weights"] == "not_in_repo":
        notes.append("weights not in the repository: saved as safetensors")
    return notes


# ---- one case ---------------------------------------------------------------------------------
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class _Worker:
    """State a worker process keeps between cases: stand-in bases and loraplex engines per family."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.engines: dict[str, Any] = {}

    def engine(self, base_dir: Path):
        key = str(base_dir)
        if key not in self.engines:
            from loraplex import LLM

            try:
                self.engines[key] = LLM(base_dir, page_tokens=8, num_pages=1024, max_num_seqs=4)
            except Exception as exc:  # noqa: BLE001 - any refusal of the base is the finding
                self.engines[key] = exc
        return self.engines[key]

    def run(self, row: dict[str, Any]) -> dict[str, Any]:
        import torch

        sys.path.insert(0, str(ROOT))
        from tests.hf_reference import greedy

        result: dict[str, Any] = {"notes": []}
        adapter_dir = self.cache / f"adapter-{row['id']}"
        try:
            base_dir = tiny_base(self.cache, row)
            if not adapter_dir.is_dir():
                result["notes"] += build_adapter(base_dir, row, adapter_dir, seed=1000 + row["id"])
            vocab = json.loads((base_dir / "config.json").read_text()).get("vocab_size") or 512
            g = torch.Generator().manual_seed(row["id"])
            prompt = torch.randint(3, min(int(vocab), 512) - 8, (PROMPT_LEN,), generator=g).tolist()
            ref_tokens, ref_logprobs = greedy(base_dir, adapter_dir, prompt, NEW_TOKENS)
            base_tokens, base_logprobs = greedy(base_dir, None, prompt, NEW_TOKENS)
            # how far the adapter moves the output: a check of an adapter that changes nothing proves little
            result["adapter_effect"] = ("tokens differ from the base's" if base_tokens != ref_tokens else
                                        f"{max(abs(a - b) for a, b in zip(base_logprobs, ref_logprobs)):.2e}")
        except Exception as exc:  # noqa: BLE001 - transformers or peft cannot build it
            return {**result, "outcome": "reference_failed", "error": _first_line(exc)}
        llm = self.engine(base_dir)
        if isinstance(llm, Exception):
            return {**result, "outcome": "unsupported_base", "error": _first_line(llm)}
        name = f"a{row['id']}"
        try:
            llm.add_adapter(name, adapter_dir)
        except Exception as exc:  # noqa: BLE001 - loraplex refused the adapter
            return {**result, "outcome": "refused", "error": _first_line(exc)}
        from loraplex import SamplingParams

        try:
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
            out = llm.generate([prompt], adapters=[name], sampling=params)[0]
        except Exception as exc:  # noqa: BLE001 - accepted, then failed while serving
            return {**result, "outcome": "serve_error", "error": _first_line(exc)}
        finally:
            llm.remove_adapter(name)
        worst = max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs))
        result["max_logprob_error"] = worst
        if out.token_ids != ref_tokens:
            first = next(i for i, (a, b) in enumerate(zip(out.token_ids, ref_tokens)) if a != b)
            return {**result, "outcome": "mismatch", "error": f"tokens differ from step {first}"}
        if worst >= LOGPROB_TOL:
            return {**result, "outcome": "mismatch", "error": f"logprob error {worst:.2e} >= {LOGPROB_TOL}"}
        return {**result, "outcome": "served_equal"}


def _quiet() -> None:
    """Progress bars and deprecation warnings of transformers / peft would bury the census's own progress."""
    import os
    import warnings

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _worker_main(conn, cache: str) -> None:
    import torch

    torch.set_num_threads(1)
    _quiet()
    worker = _Worker(Path(cache))
    while True:
        row = conn.recv()
        if row is None:
            return
        try:
            conn.send(worker.run(row))
        except BaseException as exc:  # noqa: BLE001 - a bug in the harness itself, reported per row
            conn.send({"outcome": "serve_error", "error": "census harness: " + _first_line(exc), "notes": []})


class _Pool:
    """One worker process; a case past its timeout (or a crash) replaces it."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        ctx = mp.get_context("fork")  # the parent has not imported torch
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, str(self.cache)), daemon=True)
        self.proc.start()

    def run(self, row: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        self.conn.send(row)
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
            self.stop()
            return {"outcome": "serve_error", "error": "worker process died", "notes": []}
        self.stop()
        return {"outcome": "timeout", "error": f"no answer within {timeout:g} s", "notes": []}

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                try:
                    self.conn.send(None)
                except OSError:
                    pass
                self.proc.join(2)
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join()
            self.proc = None


# ---- the census -------------------------------------------------------------------------------
def load_sample(path: Path = SAMPLE) -> dict[str, Any]:
    if path.stat().st_size > 4 << 20:
        raise SystemExit(f"{path} is over 4 MiB: not a census sample")
    return json.loads(path.read_text())


def reason_key(error: str) -> str:
    """A refusal's message with the adapter's name, paths and numbers taken out, to group by."""
    text = re.sub(r"adapter a\d+", "adapter X", error)
    text = re.sub(r"(?<![\w/])/\S+", "PATH", text)
    text = re.sub(r"\b\d+\b", "N", text)
    return text[:160]


def _moves_output(effect: str | None) -> bool:
    if effect is None:
        return False
    return effect.startswith("tokens") or float(effect) >= LOGPROB_TOL


def summarize(sample: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    outcomes = Counter(r["outcome"] for r in rows)
    denominator = len(rows) - outcomes["reference_failed"]
    refusals = Counter(reason_key(r["error"]) for r in rows if r["outcome"] in ("refused", "unsupported_base"))
    by_type: dict[str, Counter] = defaultdict(Counter)
    by_weights: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        by_type[r["model_type"]][r["outcome"]] += 1
        by_weights[r["weights"]][r["outcome"]] += 1
    equal = outcomes["served_equal"]
    # served_equal rows whose adapter moved no chosen-token logprob by 1e-3 (a weak check, named)
    weak = [r["id"] for r in rows if r["outcome"] == "served_equal" and not _moves_output(r.get("adapter_effect"))]
    return {
        "sampled": len(sample["adapters"]),
        "by_category": dict(Counter(a["category"] for a in sample["adapters"])),
        "decoder_lora_run": len(rows),
        "reference_failed": outcomes["reference_failed"],
        "denominator": denominator,
        "served_equal": equal,
        "served_equal_fraction": round(equal / denominator, 4) if denominator else None,
        "served_equal_adapter_moved_nothing": weak,
        "outcomes": dict(outcomes),
        "refusal_reasons_top10": [{"reason": k, "count": n} for k, n in refusals.most_common(10)],
        "by_model_type": {k: dict(v) for k, v in sorted(by_type.items(), key=lambda kv: -sum(kv[1].values()))},
        "by_weights_file": {k: dict(v) for k, v in by_weights.items()},
    }


def select(sample: dict[str, Any], only: str | None, ids: list[int] | None, limit: int | None) -> list[dict[str, Any]]:
    rows = [a for a in sample["adapters"] if a["category"] == "decoder_lora"]
    if ids:
        wanted = set(ids)
        rows = [a for a in sample["adapters"] if a["id"] in wanted]
        bad = [a["id"] for a in rows if a["category"] != "decoder_lora"]
        if bad:
            raise SystemExit(f"--ids {bad}: not decoder-only LoRA rows of the sample")
    if only:
        rows = [a for a in rows if a["model_type"] == only]
    return rows[:limit] if limit else rows


def run(rows: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    results = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="adapter-census-") as tmp:
        pool = _Pool(Path(tmp))
        try:
            for i, row in enumerate(rows):
                t0 = time.monotonic()
                res = pool.run(row, timeout)
                results.append({"id": row["id"], "repo": row["repo"], "path": row["path"],
                                "base_model": row["base_model"], "model_type": row["model_type"],
                                "weights": row["weights"], "seconds": round(time.monotonic() - t0, 2), **res})
                print(f"[{i + 1}/{len(rows)} {time.monotonic() - start:6.0f}s] {row['model_type']:<14} "
                      f"{res['outcome']:<16} {row['repo']}/{row['path']}"
                      + (f"  ({res['error'][:100]})" if res.get("error") else ""), file=sys.stderr, flush=True)
        finally:
            pool.stop()
    return results


def _tree() -> str:
    """The commit measured, and whether the working tree had changes beside it (others' work in progress)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object; write bench/results/adapter_census.json")
    ap.add_argument("--limit", type=int, default=None, help="run the first N adapters only")
    ap.add_argument("--only", default=None, help="run one model_type only (e.g. llama)")
    ap.add_argument("--ids", type=int, nargs="+", default=None, help="run these sample rows only (their 'id')")
    ap.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds per adapter")
    ap.add_argument("--sample", type=Path, default=SAMPLE)
    ap.add_argument("--out", type=Path, default=None, help="where --json writes (default bench/results/...)")
    args = ap.parse_args(argv)
    if args.limit is not None and not 1 <= args.limit <= 10_000:
        ap.error("--limit must be in 1..10000")
    if not 1 <= args.timeout <= 3600:
        ap.error("--timeout must be in 1..3600 s")
    sample = load_sample(args.sample)
    rows = select(sample, args.only, args.ids, args.limit)
    start = time.monotonic()
    results = run(rows, args.timeout)
    report = {"summary": summarize(sample, results), "seconds": round(time.monotonic() - start, 1),
              "tree": _tree(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "command": " ".join(["bench/adapter_census.py", *(argv if argv is not None else sys.argv[1:])]),
              "rows": results}
    if args.json:
        out = args.out or (RESULTS if not (args.limit or args.only or args.ids) else None)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report))
    else:
        s = report["summary"]
        print(f"served equal: {s['served_equal']} of {s['denominator']} "
              f"({s['served_equal_fraction']}); reference failed: {s['reference_failed']}")
        for k, n in s["outcomes"].items():
            print(f"  {k:<18} {n}")
        for item in s["refusal_reasons_top10"]:
            print(f"  {item['count']:>4}  {item['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
