"""Every bench command bench/README.md shows runs as shown, in a user's environment.

The commands are read from the README itself, so a command added there without a
place here fails `test_every_readme_command_is_classified`. Cheap ones (a few
seconds) run in the default suite; the others are slow (full-size runs of minutes)
or need a GPU. Only that each exits 0 and prints one JSON object is checked here:
the scripts' own tests check their figures.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_env import user_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "bench" / "README.md"
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*\.venv/bin/python (bench/\S+\.py[^#\n]*)", re.MULTILINE)

CHEAP = {  # a few seconds each on 2 busy cores
    "bench/page_waste.py --json",
    "bench/page_waste.py --page-tokens 8 32",
    "bench/plan_codec.py --json",
    "bench/kernels.py --device cpu --interpret --small --json",
    "bench/prefix_cache.py --quick --json",
    "bench/tp_comm.py --tp 2 --measure-tp 0",
    "bench/family_step_time.py --families llama gemma2 --batch 2 --max-tokens 4 --rounds 1 --json",
    "bench/engine_threads.py --shape tiny --rounds 1 --max-tokens 4 --json",
    "bench/cpu_gemm.py --shape tiny --rounds 1 --max-tokens 4 --json",
    "bench/lora_rows.py --json",
}
SLOW = {  # full-size runs: minutes
    "bench/cache_policies.py --json",  # 33 s on 2 busy cores; tests/test_bench_cache.py runs it smaller
    "bench/daemon_overhead.py --json",
    "bench/daemon_overhead.py --json --stub-only --stub-step-ms 5 20 --batch 1 64 256 --context 2048",
    "bench/engine_throughput.py --json",
    "bench/engine_threads.py --json",  # ~4 min at the cpu shape
    "bench/cpu_gemm.py --json",  # ~2 min at the cpu shape
    "bench/engine_throughput.py --adapters none --json",
    "bench/cache_live.py --json",
    "bench/cache_live.py --json --rounds 2",
    "bench/cache_live.py --json --duration 30 --rates 14 --policies none+stall,none,cost+stall,cost"
    " --throttle-bytes-s 5e7",
    "bench/cache_live.py --json --duration 30 --rounds 2 --rates 8,10,12,14 --throttle-bytes-s 3e7",
    "bench/flood_gap.py --json",
    "bench/abuse_gap.py --json --out bench/results/abuse_gap.json",
    "bench/flood_gap.py --json --flood-s 5",
    "bench/many_adapters.py --json",
    "bench/many_adapters.py --counts 10 1000 --json",
    "bench/prefix_cache.py --json",
    "bench/tp_comm.py --json",
    "bench/kernel_compile.py --json",
    "bench/adapter_census.py --json",  # ~3-5 min; tests/test_adapter_census.py runs 4 rows
    "bench/adapter_census.py --only qwen2 --limit 5",
    "bench/family_step_time.py --json",
    "bench/peers.py --sweep --systems loraplex peft --requests 24 --rate 1 --cores 0-1"
    " --out bench/results/peers_sweep.json",  # about an hour
    "bench/peers.py --systems loraplex peft --shape tiny --adapters 2 --requests 4 --rate 4 --max-tokens 4"
    " --prompt-len 8 --json",  # ~1-2 min: a daemon, a gateway and PEFT
}
ELSEWHERE = {  # a GPU, results of a GPU run, or a library installed by hand are needed
    "bench/grammar_mask.py --json",  # llguidance, the library xgrammar is compared with
    "bench/grammar_mask.py --steps 30 --repeats 1",
    "bench/kernels.py --json",
    "bench/engine_throughput.py --device cuda --dtype bfloat16 --batch 1 16 64 --json",
    "bench/gpu_report.py bench/results/gpu",
    "bench/peers.py --setup",  # installs vLLM's CPU build from the package index (minutes)
    "bench/peers.py --quick --json",  # needs that venv
    "bench/peers.py --systems loraplex vllm --adapters 8 --popularity uniform --client vllm-bench --requests 24"
    " --rate 1 --cores 0-1 --json",  # needs that venv too
    "bench/peers_plot.py bench/results/peers_sweep.json --out bench/results/peers_sweep.png",  # rewrites a result
}


def readme_commands() -> list[str]:
    text = re.sub(r"\\\n\s*", " ", README.read_text())  # continuation lines joined, as the shell does
    return sorted({" ".join(m.group(1).split()) for m in COMMAND.finditer(text)})


def run_as_shown(command: str, tmp_path: Path) -> None:
    args = shlex.split(command)
    env = user_env(LORAPLEX_CACHE_DIR=str(tmp_path))
    if "--interpret" in args:
        env["TRITON_INTERPRET"] = "1"  # as the README's line sets it
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if "--json" in args:
        assert isinstance(json.loads(proc.stdout), dict)  # the whole of stdout is one JSON object
    else:
        assert proc.stdout.strip()


def test_every_readme_command_is_classified() -> None:
    commands = readme_commands()
    assert "bench/daemon_overhead.py --json" in commands  # the pattern reads the README at all
    unknown = [c for c in commands if c not in CHEAP | SLOW | ELSEWHERE]
    assert not unknown, f"bench/README.md shows commands no test runs: {unknown}"


@pytest.mark.parametrize("command", sorted(CHEAP))
def test_cheap_readme_command_runs(command: str, tmp_path: Path) -> None:
    assert command in readme_commands()
    run_as_shown(command, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(SLOW))
def test_slow_readme_command_runs(command: str, tmp_path: Path) -> None:
    assert command in readme_commands()
    run_as_shown(command, tmp_path)
