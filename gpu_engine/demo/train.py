"""Train the built-in demo: a tiny Llama on Shakespeare and one LoRA per text style.

`python -m loraplex.gpu_engine.demo.train --out DIR` writes DIR/model (HF layout)
and DIR/adapters/<style> (PEFT layout) from the bundled text, seeded, in about 2.5
minutes on two idle CPU cores; progress goes to stderr. Owns the training recipe and
the files it writes; never downloads anything and never imports transformers/peft.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from .checkpoint import llama_config
from .styles import STYLES, Style
from .tiny_llama import TinyLlama
from .tokenizer import train_tokenizer, write_tokenizer

DATA_FILE = Path(__file__).parent / "data" / "tinyshakespeare.txt"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Every knob of a training run; the defaults produce the committed demo."""

    seed: int = 20240611
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    seq_len: int = 64
    batch_size: int = 32
    base_steps: int = 700
    base_lr: float = 5e-3
    base_style_share: float = 0.25  # share of base-training lines written in one of the styles
    lora_rank: int = 16
    lora_alpha: float = 32.0
    adapter_steps: int = 120
    adapter_lr: float = 1e-2
    warmup_steps: int = 20
    save_dtype: str = "float16"

    def model_config(self) -> dict[str, Any]:
        return llama_config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
            max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype=self.save_dtype,
        )


def log(msg: str) -> None:
    print(f"loraplex demo train: {msg}", file=sys.stderr, flush=True)


def load_text() -> str:
    return DATA_FILE.read_text(encoding="utf-8")


def mixed_styles(text: str, share: float, seed: int) -> str:
    """`text` with a random `share` of its lines rewritten in a random style."""
    if share <= 0:
        return text
    rng = random.Random(seed)
    lines = text.split("\n")
    out = [rng.choice(STYLES).transform(line) if rng.random() < share else line for line in lines]
    return "\n".join(out)


def build_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """BPE over the text and every styled copy, so each style has whole-word tokens."""
    corpus = [text] + [style.apply(text) for style in STYLES]
    return train_tokenizer((line + "\n" for doc in corpus for line in doc.split("\n")), vocab_size)


def encode(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text).ids, dtype=torch.int64)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def fit(model: TinyLlama, params: Sequence[torch.nn.Parameter], data: torch.Tensor, *, steps: int, lr: float,
        cfg: TrainConfig, seed: int, label: str) -> list[float]:
    """AdamW on random windows of `data`; returns the loss of every step."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    offsets = torch.arange(cfg.seq_len + 1)
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, cfg.warmup_steps)
        starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        window = data[starts[:, None] + offsets]  # [batch, seq + 1]
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            rate = (step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - started)
            log(f"{label} step {step + 1}/{steps} loss {losses[-1]:.3f} ({rate:.0f} tokens/s)")
    return losses


def train_base(cfg: TrainConfig, tokenizer: Tokenizer, text: str) -> tuple[TinyLlama, list[float]]:
    model = TinyLlama(cfg.model_config(), seed=cfg.seed)
    log(f"base model: {sum(p.numel() for p in model.parameters()):,} parameters")
    data = encode(tokenizer, mixed_styles(text, cfg.base_style_share, cfg.seed))
    log(f"base corpus: {data.numel():,} tokens")
    losses = fit(model, list(model.parameters()), data, steps=cfg.base_steps, lr=cfg.base_lr, cfg=cfg,
                 seed=cfg.seed + 1, label="base")
    return model, losses


def train_adapter(cfg: TrainConfig, base_state: dict[str, torch.Tensor], tokenizer: Tokenizer, text: str,
                  style: Style, index: int) -> tuple[TinyLlama, list[float]]:
    model = TinyLlama(cfg.model_config(), seed=cfg.seed)
    model.load_hf_state_dict(base_state)
    params = model.add_lora(cfg.lora_rank, cfg.lora_alpha, TARGETS, seed=cfg.seed + 100 + index)
    data = encode(tokenizer, style.apply(text))
    losses = fit(model, params, data, steps=cfg.adapter_steps, lr=cfg.adapter_lr, cfg=cfg,
                 seed=cfg.seed + 200 + index, label=style.name)
    return model, losses


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_model(dest: Path, cfg: TrainConfig, model: TinyLlama, tokenizer: Tokenizer) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    config = cfg.model_config()
    _write_json(dest / "config.json", config)
    save_file(model.hf_state_dict(getattr(torch, cfg.save_dtype)), str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(dest, tokenizer)
    _write_json(dest / "generation_config.json",
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})


def write_adapter(dest: Path, cfg: TrainConfig, model: TinyLlama) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest / "adapter_config.json", {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
        "target_modules": sorted(TARGETS), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": "loraplex-demo-trained", "inference_mode": True,
    })
    save_file(model.peft_state_dict(getattr(torch, cfg.save_dtype)), str(dest / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def train(out: Path, cfg: TrainConfig, text_fn: Callable[[], str] = load_text) -> dict[str, Any]:
    """Run the whole recipe into `out`; returns the training summary also written to out/training.json."""
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    text = text_fn()
    tokenizer = build_tokenizer(text, cfg.vocab_size)
    log(f"tokenizer: {cfg.vocab_size} tokens from {len(text):,} characters")
    model, base_losses = train_base(cfg, tokenizer, text)
    write_model(out / "model", cfg, model, tokenizer)
    # Adapters train on the base as it is saved (rounded to save_dtype), as it will be served.
    base_state = model.hf_state_dict(getattr(torch, cfg.save_dtype))
    summary: dict[str, Any] = {"config": dataclasses.asdict(cfg), "base_loss": _ends(base_losses), "adapters": {}}
    for index, style in enumerate(STYLES):
        adapted, losses = train_adapter(cfg, base_state, tokenizer, text, style, index)
        write_adapter(out / "adapters" / style.name, cfg, adapted)
        summary["adapters"][style.name] = {"description": style.description, "loss": _ends(losses)}
    _write_json(out / "training.json", summary)
    log(f"done in {time.perf_counter() - started:.0f} s: {out}")
    return summary


def _ends(losses: list[float]) -> dict[str, float]:
    tail = losses[-10:]
    return {"first": round(losses[0], 3), "last10_mean": round(sum(tail) / len(tail), 3)}


def main(argv: Sequence[str] | None = None) -> int:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(prog="python -m loraplex.gpu_engine.demo.train", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory to write model/ and adapters/ into")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name),
                            help=f"(default {getattr(defaults, field.name)})")
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    train(args.out, cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
