"""lm-evaluation-harness against the gateway, as a user runs it: `lm_eval --model
local-completions` on a real daemon (the demo model, one adapter) through the OpenAI gateway on
loopback, with two local tasks written here (no downloads): a multiple-choice task (loglikelihood
requests: echo, logprobs, max_tokens 1) and a generate_until task. The harness lives in its own
venv under the user's cache, built once and reused; it borrows the project venv's torch,
transformers and peft through a .pth file instead of downloading another torch. The accuracy it
reports is the one transformers + PEFT's logprobs give (tests/test_prompt_logprobs_e2e.py sends
the same requests in the fast suite)."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplex.gateway.config import GatewayConfig
from tests.daemon_process import DaemonProcess
from tests.hf_reference import prompt_logprobs as reference
from tests.test_gateway_e2e import GatewayThread
from tests.test_prompt_logprobs_e2e import _token_tol

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")
pytest.importorskip("peft")

LM_EVAL = "lm-eval[api]==0.4.13"  # api: the HTTP clients of local-completions
ADAPTER = "all-r32"

MC_TASK = """task: loraplex_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_TASK = """task: loraplex_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
QUESTIONS = [
    ("The river ran", ["north", "south", "under the bridge", "dry"], 2),
    ("Once upon a time there was", ["a king", "nothing", "a dragon in the hills", "rain"], 0),
    ("She opened the door and saw", ["the sea", "a cat", "her old friend", "light"], 1),
    ("Two plus two is", ["four", "five", "a number", "green"], 0),
    ("The bells rang at", ["noon", "midnight", "dawn", "the wedding"], 3),
    ("He wrote a letter to", ["his mother", "the king", "nobody", "the editor"], 1),
]


def _venv() -> Path:
    """The harness's venv (LORAPLEX_LM_EVAL_VENV, else under the user's cache), built once."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = Path(os.environ.get("LORAPLEX_LM_EVAL_VENV") or cache / "loraplex-tests" / "lm-eval-0.4.13")
    ready = root / ".ready"
    if ready.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build, whoever asks first
        if ready.exists():
            return root
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
        site = next((root / "lib").glob("python*/site-packages"))
        ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
        (site / "loraplex-project-venv.pth").write_text("\n".join(ours) + "\n")
        subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        LM_EVAL], check=True, timeout=1800)
        ready.write_text(LM_EVAL + "\n")
    return root


@pytest.fixture(scope="module")
def served(demo, tmp_path_factory):
    daemon = DaemonProcess(tmp_path_factory.mktemp("lmeval")).start()
    gateway = GatewayThread(GatewayConfig(port=0, runtime_dir=daemon.runtime_dir, stats_cache_s=0.0)).start()
    yield gateway
    gateway.close()
    assert daemon.stop() == 0, daemon.log()


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair: trailing spaces move to the continuation, whose tokens are
    what the whole string has beyond the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids):]


def _loglikelihood(model_dir: Path, adapter_dir: Path, context: list[int], continuation: list[int]) -> float:
    ref = reference(model_dir, adapter_dir, context + continuation)
    rows = ref[len(context) - 1: len(context) + len(continuation) - 1]
    return float(rows.gather(1, torch.tensor(continuation)[:, None]).sum())


def _samples(out: Path, task: str) -> list[dict]:
    found = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert found, f"no samples for {task} under {out}"
    return [json.loads(line) for line in found[-1].read_text().splitlines() if line.strip()]


def test_lm_eval_local_completions_runs_loglikelihood_and_generate_tasks(served, demo, tmp_path):
    venv = _venv()
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    mc = tasks / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS))
    gen = tasks / "gen.jsonl"
    gen.write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n" for q, c, a in QUESTIONS))
    (tasks / "loraplex_mc.yaml").write_text(MC_TASK.format(data=mc))
    (tasks / "loraplex_gen.yaml").write_text(GEN_TASK.format(data=gen))
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model={ADAPTER},base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={demo.model_dir},tokenized_requests=True,num_concurrent=2,max_retries=1,max_length=512")
    run = subprocess.run([str(venv / "bin" / "lm_eval"), "--model", "local-completions", "--model_args", model_args,
                          "--tasks", "loraplex_mc,loraplex_gen", "--include_path", str(tasks), "--batch_size", "2",
                          "--output_path", str(out), "--log_samples"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    results = json.loads(sorted(out.rglob("results_*.json"))[-1].read_text())["results"]
    acc = results["loraplex_mc"]["acc,none"]
    assert "exact_match,none" in results["loraplex_gen"]
    assert all(isinstance(s["resps"][0][0], str) for s in _samples(out, "loraplex_gen"))
    # The same accuracy from transformers + PEFT's logprobs, tokenized as lm-eval tokenizes.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo.model_dir))
    adapter_dir = demo.adapters[ADAPTER]
    tol = _token_tol(demo.model_dir)  # per token: float32 engine vs float64 reference
    samples = {s["doc"]["question"]: s for s in _samples(out, "loraplex_mc")}
    correct, ties = 0, 0
    for question, choices, label in QUESTIONS:
        lls = []
        for choice in choices:
            context, continuation = _encode_pair(tokenizer, question, " " + choice)
            lls.append((_loglikelihood(demo.model_dir, adapter_dir, context, continuation), len(continuation)))
        served_lls = [r[0] for r in samples[question]["filtered_resps"]]
        for (want, n), got in zip(lls, served_lls, strict=True):
            assert abs(float(got) - want) < tol * n, f"{question!r}: {got} vs {want}"
        ranked = sorted(ll for ll, _ in lls)
        ties += ranked[-1] - ranked[-2] < 2 * tol * max(n for _, n in lls)
        correct += max(range(len(lls)), key=lambda i: lls[i][0]) == label
    assert abs(acc - correct / len(QUESTIONS)) <= ties / len(QUESTIONS) + 1e-9, (acc, correct, ties)
