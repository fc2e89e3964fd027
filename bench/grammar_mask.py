"""Per-token grammar mask time of xgrammar and llguidance on the CPU, batch 64.

For each library and tokenizer (the demo model's, 1,024 tokens, and a byte-level
BPE of 32,000 tokens, a Llama-2-sized vocabulary, trained here on the demo's text
and the Python sources of the installed torch package, for want of a real one
offline), 64 matchers walk one JSON schema in lock step: per step every row's
next-token bitmask is filled (timed, sequentially per row as the engine's sampler
does, and with each library's own batch call), then each row takes a random
allowed token. A row whose grammar ended starts over. Compile times are not
comparable: llguidance compiles lazily, when its first matcher is built. Prints one
JSON object with --json; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "role"],
}


def _corpus(shakespeare: Path, megabytes: float) -> list[str]:
    texts, size = [shakespeare.read_text()], 0
    for path in sorted(Path(torch.__file__).parent.rglob("*.py")):
        if size > megabytes * 1e6:
            break
        text = path.read_text(errors="replace")
        texts.append(text)
        size += len(text)
    return texts


def big_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = tok.get_vocab(with_added_tokens=True)
        encoded = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            encoded[i] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        info = xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=len(encoded),
                                 stop_token_ids=[eos], add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher, mask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError("xgrammar refused an allowed token")

    def ended(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, eos: int) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tok.to_str(), eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema: str):
        return self.llg.LLMatcher.grammar_from_json_schema(schema)

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher, mask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, mask, row)

    def fill_batch(self, matchers: list, mask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused an allowed token: {matcher.get_error()}")

    def ended(self, matcher) -> bool:
        return matcher.is_stopped()


def allowed_tokens(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab] bool."""
    bits = torch.arange(32, dtype=torch.int32)
    return ((mask[:, :, None] >> bits) & 1).bool().reshape(mask.shape[0], -1)[:, :vocab]


def run(lib, vocab: int, eos: int, batch: int, steps: int, batched: bool, seed: int) -> dict[str, float]:
    t0 = time.perf_counter()
    grammar = lib.compile(json.dumps(SCHEMA))
    compile_ms = (time.perf_counter() - t0) * 1e3
    matchers = [lib.matcher(grammar) for _ in range(batch)]
    mask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        if batched:
            lib.fill_batch(matchers, mask)
        else:
            for row, matcher in enumerate(matchers):
                lib.fill(matcher, mask, row)
        times.append(time.perf_counter() - t)
        allowed = allowed_tokens(mask, vocab).float()
        picks = torch.multinomial(allowed + 1e-12 * (allowed.sum(1, keepdim=True) == 0), 1, generator=gen)[:, 0]
        for row, matcher in enumerate(matchers):
            token = int(picks[row])
            if token == eos or lib.ended(matcher):
                matchers[row] = lib.matcher(grammar)
                continue
            lib.accept(matcher, token)
            if lib.ended(matcher):
                matchers[row] = lib.matcher(grammar)
    step_ms = statistics.median(times) * 1e3
    return {"compile_ms": round(compile_ms, 3), "step_ms_p50": round(step_ms, 4),
            "step_ms_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e3, 4),
            "per_row_us": round(step_ms * 1e3 / batch, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--big-vocab", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; the lowest median counts")
    parser.add_argument("--corpus-mb", type=float, default=24.0, help="Python source to train the BPE on")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    demo_dir = Path(__file__).resolve().parents[1] / "gpu_engine" / "demo"
    demo_tok = Tokenizer.from_file(str(demo_dir / "trained" / "model" / "tokenizer.json"))
    print(f"training a {args.big_vocab}-token byte-level BPE...", file=sys.stderr)
    big_tok = big_tokenizer(_corpus(demo_dir / "data" / "tinyshakespeare.txt", args.corpus_mb), args.big_vocab)
    results: dict[str, object] = {"batch": args.batch, "steps": args.steps, "repeats": args.repeats, "threads": 1,
                                  "schema": SCHEMA,
                                  "libraries": {}}
    versions = {}
    for tok_name, tok in (("demo", demo_tok), ("bpe", big_tok)):
        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos = tok.token_to_id("</s>")
        for cls in (XGrammar, LLGuidance):
            lib = cls(tok, eos)
            versions[lib.name] = importlib.metadata.version(lib.name)
            for batched in (False, True):
                mode = "batch_call" if batched else "per_row"
                print(f"{lib.name} {tok_name} (vocab {vocab}) {mode}...", file=sys.stderr)
                # The lowest median of the repeats: the machine is shared, and noise only adds time.
                out = min((run(lib, vocab, eos, args.batch, args.steps, batched, args.seed + r)
                           for r in range(args.repeats)), key=lambda r: r["step_ms_p50"])
                results["libraries"].setdefault(lib.name, {}).setdefault(f"{tok_name}_{vocab}", {})[mode] = out
    results["versions"] = versions
    if args.json:
        print(json.dumps(results))
    else:
        for lib, by_tok in results["libraries"].items():
            for tok_name, modes in by_tok.items():
                for mode, r in modes.items():
                    print(f"{lib:11s} {tok_name:12s} {mode:10s} step p50 {r['step_ms_p50']:.3f} ms  "
                          f"{r['per_row_us']:.2f} us/row  compile {r['compile_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
