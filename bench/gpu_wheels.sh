#!/usr/bin/env bash
# Fetch the cp312 wheels a GPU validation host lacks into .whl/ (git-ignored; carry it to the host).
# The host image already has torch, triton, numpy, msgpack, uvloop, pybind11, safetensors, tokenizers,
# aiohttp, prometheus-client, jinja2, rich, markdown-it-py, pygments, transformers, peft, pytest and
# hypothesis; loraplex still needs these. Versions follow this checkout's .venv when it has them, so
# the host runs what the suite tested. Usage: bench/gpu_wheels.sh [DEST]   (then see bench/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
wheels=(pyzmq textual mdit-py-plugins platformdirs setuptools)
pins=()
for name in "${wheels[@]}"; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
  pins+=("$name${version:+==$version}")
done
rm -rf "$dest" && mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dest" "${pins[@]}"
ls -1 "$dest" >&2
du -sh "$dest" >&2
