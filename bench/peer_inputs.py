"""What every system of bench/peers.py serves, written once under the work folder: one
random-weight checkpoint (a bench/model_shapes.py shape with the trained demo's tokenizer, so
every system detokenizes alike) and the PEFT adapters of each sweep point.

An adapter set is N adapters of one rank or of mixed ranks (8-128 in turn) on q/k/v/o. Only the
first DISTINCT of a set have weights of their own; the rest are hard links to the files of the
one DISTINCT places before them (the same rank): every server still registers, loads and places
each as its own adapter, while 1,024 adapters of rank up to 128 stay under a gigabyte of disk.
The cold adapters of the cold-start probe are written apart, never in a workload.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from model_shapes import shape_config

from loraplex.gpu_engine.demo import builtin_demo, write_random_adapter, write_random_checkpoint

MIXED_RANKS = (8, 16, 32, 64, 128)
DISTINCT = 80  # adapters of a set with weights of their own (a multiple of len(MIXED_RANKS))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class SweepPoint:
    """One workload of the sweep: N distinct adapters, their popularity, their ranks."""

    adapters: int
    popularity: str  # uniform | zipf
    ranks: str  # one rank ("16") or "mixed"

    @property
    def key(self) -> str:
        return f"{self.adapters}-{self.popularity}-r{self.ranks}"

    def rank_of(self, i: int) -> int:
        return MIXED_RANKS[i % len(MIXED_RANKS)] if self.ranks == "mixed" else int(self.ranks)


def log(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def write_checkpoint(work: Path, shape: str, seed: int) -> tuple[Path, dict]:
    """The shape's checkpoint with the demo's vocabulary and tokenizer; its config."""
    demo = builtin_demo().model_dir
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    config = {**shape_config(shape), "vocab_size": vocab}
    model_dir = work / f"model-{shape}"
    if not (model_dir / "model.safetensors").exists():
        log(f"writing the {shape} checkpoint")
        write_random_checkpoint(model_dir, config, seed=seed)
        for name in TOKENIZER_FILES:
            shutil.copy(demo / name, model_dir / name)
    return model_dir, config


def _write(path: Path, config: dict, rank: int, seed: int) -> None:
    if not (path / "adapter_config.json").exists():
        write_random_adapter(path, config, rank=rank, alpha=2.0 * rank, target_modules=TARGETS, seed=seed)


def _link(source: Path, path: Path) -> None:
    if (path / "adapter_config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        os.link(f, path / f.name)


def adapter_set(work: Path, config: dict, point: SweepPoint) -> dict[str, Path]:
    """The point's adapters (name -> folder), written or linked on first use."""
    adapters: dict[str, Path] = {}
    for i in range(point.adapters):
        rank = point.rank_of(i)
        name = f"a{i:04d}-r{rank}"
        path = work / "adapters" / f"ranks-{point.ranks}" / name
        if i < DISTINCT:
            _write(path, config, rank, seed=100 + i)
        else:
            source = work / "adapters" / f"ranks-{point.ranks}" / f"a{i % DISTINCT:04d}-r{rank}"
            _write(source, config, rank, seed=100 + i % DISTINCT)
            _link(source, path)
        adapters[name] = path
    return adapters


def cold_set(work: Path, config: dict, point: SweepPoint, count: int) -> dict[str, Path]:
    """`count` adapters of the point's ranks that no workload uses: each server's first request
    for one finds it on disk only."""
    adapters = {}
    for i in range(count):
        rank = point.rank_of(i)
        name = f"cold{i:02d}-r{rank}"
        path = work / "adapters" / "cold" / name
        _write(path, config, rank, seed=10_000 + i)
        adapters[name] = path
    return adapters
