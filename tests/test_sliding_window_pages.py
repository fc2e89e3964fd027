"""Sliding-window KV release (issue 32): on a model whose every attention layer slides
(Mistral with sliding_window), the pages wholly before the window of a sequence's next token
go back to the pool while it runs, and its output stays equal to transformers + PEFT.

The offline `LLM` serves a random Mistral-style checkpoint (window 16, 4-token pages) a
sequence 4x its window; a hook on the scheduler records the pages each sequence holds at
every plan, and the pool's KV pages net of idle cached prefixes (what `loraplex stats`
shows as pool.kv).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.daemon.scheduler.kv_pages import KvPages
from loraplex.daemon.scheduler.sequence import Sequence
from loraplex.gpu_engine.demo import mistral_config, write_random_adapter, write_random_checkpoint
from loraplex.gpu_engine.pool import kv_window
from tests.hf_reference import greedy
from tests.tolerances import forward_tolerance

pytest.importorskip("transformers")
pytest.importorskip("peft")

WINDOW, PAGE = 16, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("sliding")
    config = mistral_config(sliding_window=WINDOW, num_attention_heads=4, num_key_value_heads=2)
    write_random_checkpoint(root / "model", config, seed=int(torch.randint(1 << 30, ())))
    write_random_adapter(root / "a8", config, rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj"],
                         seed=int(torch.randint(1 << 30, ())))
    return root / "model", root / "a8", config


def _watch(llm: LLM) -> dict[str, int]:
    """Record, at every plan, the most pages any sequence held and the pool's KV pages held by
    sequences (allocated KV less idle cached prefixes, as the daemon's stats count pool.kv)."""
    peak = {"seq": 0, "pool_kv": 0}
    sched = llm.scheduler
    schedule = sched.schedule

    def watched():
        plan = schedule()
        held = [sched.kv.held_pages(s) for s in sched.running]
        peak["seq"] = max([peak["seq"], *held])
        idle = sched.prefix.idle_pages if sched.prefix is not None else 0
        peak["pool_kv"] = max(peak["pool_kv"], llm.allocator.usage().by_tag.get("kv", 0) - idle)
        return plan

    sched.schedule = watched
    return peak


def _prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,)).tolist()


def test_a_sequence_four_windows_long_holds_one_window_and_matches_peft(model) -> None:
    model_dir, adapter_dir, config = model
    llm = LLM(model_dir, page_tokens=PAGE, num_pages=64)
    llm.add_adapter("a8", adapter_dir)
    assert llm.scheduler.config.kv_window == WINDOW == kv_window(llm.config.layer_windows)
    peak = _watch(llm)
    prompt = _prompt(WINDOW - 4, config["vocab_size"])
    new = 4 * WINDOW - len(prompt)  # the sequence ends 4 windows long
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=True)
    for adapter in (None, "a8"):
        out = llm.generate([prompt], adapters=[adapter], sampling=params)[0]
        ref_tokens, ref_logprobs = greedy(model_dir, adapter_dir if adapter else None, prompt, new)
        assert out.token_ids == ref_tokens, f"adapter {adapter}: tokens differ from transformers + PEFT"
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_logprobs)) < forward_tolerance(llm.config)
    # the window's pages and the page being written; without release it would hold 4 windows
    assert peak["seq"] <= WINDOW // PAGE + 1, peak
    assert peak["pool_kv"] <= WINDOW // PAGE + 1, peak
    assert llm.scheduler.kv.released >= 2 * (4 * WINDOW - WINDOW) // PAGE - 2


def test_long_prompts_in_chunks_and_preemption_stay_exact(model) -> None:
    """A prompt 3 windows long prefilled in 8-token chunks (each chunk sees a window of released
    pages behind it), and a pool small enough that one of two long sequences is preempted and
    recomputed: every output equals transformers + PEFT."""
    model_dir, adapter_dir, config = model
    chunk = 8
    llm = LLM(model_dir, page_tokens=PAGE, num_pages=20, max_batched_tokens=chunk)
    llm.add_adapter("a8", adapter_dir)
    assert llm.scheduler.prefix is None  # off on a model whose every layer slides
    peak = _watch(llm)
    prompt = _prompt(3 * WINDOW, config["vocab_size"])
    other = _prompt(2 * WINDOW + 3, config["vocab_size"])
    new = WINDOW + 5
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompt, other], adapters=["a8", None], sampling=params)
    assert outs[0].token_ids == greedy(model_dir, adapter_dir, prompt, new)[0]
    assert outs[1].token_ids == greedy(model_dir, None, other, new)[0]
    assert peak["seq"] <= -(-(WINDOW - 1 + chunk) // PAGE) + 1, peak
    assert llm.scheduler.num_preemptions >= 1, "the pool was meant to be too small for both at once"
    assert llm.allocator.usage().by_tag.get("kv", 0) == 0  # every page came back


def test_slide_frees_whole_pages_behind_the_window_and_drop_skips_placeholders() -> None:
    """Unit: which pages leave, what the table keeps, what leaving and worst-case sizing count."""
    from loraplex.contracts.geometry import PageGeometry
    from loraplex.daemon.memory.adapter_residency import AdapterResidency
    from loraplex.daemon.memory.allocator import KV, PageAllocator
    from loraplex.daemon.scheduler.config import SchedulerConfig
    from loraplex.daemon.scheduler.prefix_reuse import PrefixReuse
    from loraplex.daemon.scheduler.sequence import SeqRequest
    from loraplex.ipc.engine_plan import SamplingSpec

    config = SchedulerConfig(kv_window=8, max_batched_tokens=8)
    alloc = PageAllocator(32)
    prefix = PrefixReuse(config, alloc, PAGE, clock=lambda: 0.0)
    assert prefix.cache is None  # off with a window (prefix_reuse.py says why)
    kv = KvPages(config, PageGeometry(kv_dim=8, page_tokens=PAGE, max_row_width=8), alloc,
                 AdapterResidency(alloc, "lru"), lambda name: 0, prefix)
    req = SeqRequest("r", list(range(3, 30)), None, SamplingSpec(), 400)
    seq = Sequence(req)
    seq.kv_pages = alloc.allocate(6, KV)
    pages = list(seq.kv_pages)
    seq.num_computed = 12  # the next token, at 12, sees keys 5..12: page 0 (keys 0-3) only is out
    assert kv.slide(seq) == 1 and kv.slide(seq) == 0
    seq.num_computed = 20  # keys 13..20: pages 0-2 are out
    assert kv.slide(seq) == 2
    assert seq.kv_pages == [kv.placeholder] * 3 + pages[3:] and kv.held_pages(seq) == 3
    assert alloc.num_free == 32 - 3 and kv.placeholder == alloc.num_pages  # no allocator page
    seq.num_computed = 26  # overlap: 6 of them fed by launched steps whose results have not come
    assert kv.slide(seq, unsettled=6) == 0  # the window is taken from 20, where a failed step resumes
    assert kv.slide(seq) == 1
    kv.drop(seq)
    assert alloc.num_free == 32 and seq.released_pages == 0 and kv.released == 4
    # a request far longer than the pool fits: it holds a window and a chunk at most
    assert kv.worst(req) == -(-(8 - 1 + 8) // PAGE) + 1 < 32 < -(-(len(req.prompt_ids) + 400) // PAGE)
    kv.check_pool(req)
    with pytest.raises(ValueError, match="kv_window"):
        SchedulerConfig(kv_window=0)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_a_daemon_serves_four_windows_holding_one_window_in_stats(model, tmp_path: Path, overlap: bool) -> None:
    """Through `loraplex serve`: the engine reports the window in its hello, and `loraplex stats`
    (pool.kv: pages held by sequences) never shows more than a window and a page (one more with a
    step launched ahead) while a sequence 4 windows long streams; its tokens equal transformers."""
    from tests.daemon_process import DaemonProcess

    model_dir, adapter_dir, config = model
    proc = DaemonProcess(tmp_path, "--model", str(model_dir), "--num-pages", "64",
                         env={"LORAPLEX_MODEL_PAGE_TOKENS": str(PAGE),
                              "LORAPLEX_SCHEDULER_OVERLAP": str(overlap).lower()}).start()
    try:
        with proc.client() as client, proc.client() as watcher:
            prompt = _prompt(WINDOW - 4, config["vocab_size"])
            new = 4 * WINDOW - len(prompt)
            seen = []
            with client.stream(prompt, max_tokens=new, temperature=0.0, ignore_eos=True, timeout=120) as stream:
                for _ in stream:
                    seen.append(watcher.stats()["pool"]["kv"])
                tokens = stream.finished_result().token_ids
        assert tokens == greedy(model_dir, None, prompt, new)[0]
        assert len(seen) >= new // 2 and 0 < max(seen) <= WINDOW // PAGE + 1 + overlap, seen
        assert "prefix cache off" in proc.log()
    finally:
        assert proc.stop() == 0, proc.log()


def test_launched_steps_count_the_tokens_they_assumed_computed() -> None:
    from loraplex.daemon.scheduler.lookahead import LaunchedSteps
    from loraplex.daemon.scheduler.sequence import SeqRequest, SeqStatus
    from loraplex.ipc.engine_plan import RowPlan, SamplingSpec, StepPlan

    seqs = {name: Sequence(SeqRequest(name, [5, 6, 7], None, SamplingSpec(), 8), status=SeqStatus.RUNNING)
            for name in ("a", "b")}
    steps = LaunchedSteps()
    for step_id, fed in enumerate(({"a": 3, "b": 2}, {"a": 1})):
        rows = [RowPlan(name, [5] * n, 0, [], None, False, SamplingSpec()) for name, n in fed.items()]
        steps.launch(StepPlan(step_id, rows), fed, seqs)
    assert steps.unsettled(seqs["a"]) == 4 and steps.unsettled(seqs["b"]) == 2
    seqs["b"].num_preemptions += 1  # preempted since: what it launched before is not its KV any more
    assert steps.unsettled(seqs["b"]) == 0
