"""Adapter directories built to attack whoever opens them: a FIFO as the
weights file, symlinks pointing out of the allowed directory at a secret, int64
tensors, a safetensors header that claims a huge length, a pickled .bin that is
a symlink out or a FIFO, and a copy of a valid adapter. Each is a copy of a real
demo adapter with one thing changed."""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
BIN = "adapter_model.bin"
CONFIG = "adapter_config.json"
SECRET = "s3cr3t-ROOT-PASSWORD-line-that-must-never-be-echoed"


def valid(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def fifo_weights(source: Path, dest: Path, weights: str = WEIGHTS) -> Path:
    """The weights file (`weights`: the safetensors or the .bin) is a FIFO nobody writes: opening it
    blocks forever."""
    dest.mkdir(parents=True)
    shutil.copy(source / CONFIG, dest / CONFIG)
    os.mkfifo(dest / weights)
    return dest


def symlink_out(source: Path, dest: Path, outside: Path, weights: str = WEIGHTS) -> Path:
    """The weights file (`weights`: the safetensors or the .bin) is a symlink to a secret outside
    the allowed directory."""
    dest.mkdir(parents=True)
    shutil.copy(source / CONFIG, dest / CONFIG)
    outside.mkdir(parents=True, exist_ok=True)
    secret = outside / "shadow"
    secret.write_text(SECRET * 64 + "\n")
    os.symlink(secret, dest / weights)
    return dest


def as_bin(source: Path, dest: Path) -> Path:
    """The same adapter with its tensors in a pickled adapter_model.bin (torch.save), no safetensors."""
    dest.mkdir(parents=True)
    shutil.copy(source / CONFIG, dest / CONFIG)
    torch.save(load_file(str(source / WEIGHTS)), dest / BIN)
    return dest


def int64_weights(source: Path, dest: Path) -> Path:
    """Right names and shapes, but every tensor int64 (random nonzero values)."""
    valid(source, dest)
    tensors = load_file(str(dest / WEIGHTS))
    g = torch.Generator().manual_seed(20)
    save_file({k: torch.randint(1, 1000, t.shape, generator=g, dtype=torch.int64) for k, t in tensors.items()},
              str(dest / WEIGHTS))
    return dest


def huge_header(source: Path, dest: Path) -> Path:
    """The 8-byte header length claims 2**40 bytes; the rest is random."""
    dest.mkdir(parents=True)
    shutil.copy(source / CONFIG, dest / CONFIG)
    (dest / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + os.urandom(4096))
    return dest
