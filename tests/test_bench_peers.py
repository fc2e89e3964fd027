"""bench/peers.py's parts that need no peer installed: the seeded workload, the open-loop
streaming client against a real loopback HTTP server, the summary, the text comparison and the
ratios. (The side-by-side run itself needs vLLM's venv: bench/README.md.)"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

from bench.peer_workload import PeerResult, drive, make_workload, summarize

BENCH = Path(__file__).resolve().parents[1] / "bench"


def workload(**overrides):
    args = dict(seed=3, requests=400, rate=5.0, adapters=["a", "b", "c", "d"], popularity="zipf", prompt_len=6,
                max_tokens=3, vocab=(3, 50))
    return make_workload(**{**args, **overrides})


def test_the_workload_is_seeded_and_open_loop():
    one, two = workload(), workload()
    assert one == two, "every system must see the same requests"
    assert one != workload(seed=4)
    arrivals = [r.arrival_s for r in one]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert 400 / 5.0 * 0.8 < arrivals[-1] < 400 / 5.0 * 1.2, "Poisson at the rate asked"
    assert all(len(r.prompt) == 6 and all(3 <= t < 50 for t in r.prompt) for r in one)
    counts = Counter(r.adapter for r in one)
    assert counts["a"] > 1.5 * counts["c"] > 0, "Zipf: the first adapter is the most popular"
    flat = Counter(r.adapter for r in workload(popularity="uniform"))
    assert max(flat.values()) < 1.5 * min(flat.values())
    assert {r.adapter for r in workload(adapters=[])} == {None}, "no adapters: the base model"
    with pytest.raises(ValueError, match="popularity"):
        workload(popularity="pareto")


def test_summary_percentiles_and_failures():
    results = [PeerResult(i, True, ttft_s=0.01 * (i + 1), e2e_s=0.01 * (i + 1) + 0.2, tokens=5) for i in range(10)]
    results.append(PeerResult(10, False, error="HTTP 500: boom"))
    s = summarize(results, elapsed_s=2.0)
    assert s["finished"] == 10 and s["failed"] == 1 and s["output_tokens"] == 50 and s["output_tok_s"] == 25.0
    assert s["ttft_ms_p50"] == 60.0 and s["ttft_ms_p99"] == 100.0
    assert s["tpot_ms_p50"] == pytest.approx(50.0)  # (0.2 s between first and last) / 4
    assert s["errors"] == ["HTTP 500: boom"]


async def _serve(port_box: list[int], seen: list[dict], stop: asyncio.Event) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body["model"] == "broken":
            return web.json_response({"error": "no such model"}, status=404)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await resp.write(f"data: {json.dumps({'choices': [{'text': f't{i} '}]})}\n\n".encode())
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 3}})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_box.append(site._server.sockets[0].getsockname()[1])
    await stop.wait()
    await runner.cleanup()


def test_the_client_streams_each_request_at_its_time():
    requests = workload(requests=6, rate=50.0, max_tokens=3, adapters=["a", "broken"], popularity="uniform")

    async def scenario():
        port, seen, stop = [], [], asyncio.Event()
        server = asyncio.create_task(_serve(port, seen, stop))
        while not port:
            await asyncio.sleep(0.01)
        try:
            results, elapsed = await drive(f"http://127.0.0.1:{port[0]}/v1/completions", "base", requests,
                                           timeout_s=30)
        finally:
            stop.set()
            await server
        return results, elapsed, seen

    results, elapsed, seen = asyncio.run(scenario())
    assert elapsed >= requests[-1].arrival_s
    assert [r.index for r in results] == list(range(6))
    for req, res in zip(requests, results):
        if req.adapter == "broken":
            assert not res.ok and res.error.startswith("HTTP 404")
        else:
            assert res.ok and res.tokens == 3 and res.text == "t0 t1 t2 " and 0 < res.ttft_s <= res.e2e_s
    assert all(b["temperature"] == 0.0 and b["ignore_eos"] and b["stream"] for b in seen)
    assert sorted(b["prompt"] for b in seen) == sorted(r.prompt for r in requests)


def _bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCH))


def test_texts_are_checked_against_peft_and_ratios_taken_against_loraplex():
    report = _bench_module("peer_report")
    point = _bench_module("peer_inputs").SweepPoint(64, "zipf", "mixed")

    def entry(system, tok_s, at=point):
        return report.result_entry(system, at, 1.0, {"summary": {"output_tok_s": tok_s, "finished": 3}})

    entries = [entry("loraplex", 30.0), entry("vllm", 10.0), entry("peft", 5.0),
               report.result_entry("broken", point, 1.0, {"error": "could not start"})]
    texts = {"loraplex": {0: "x", 1: "y"}, "vllm": {0: "x", 1: "z", 2: "w"}, "peft": {0: "x", 1: "y", 2: "w"}}
    report.check_texts(entries, {**_outputs(report, texts), "broken": None})
    by = {e["system"]: e for e in entries}
    assert (by["loraplex"]["wrong_outputs"], by["loraplex"]["checked_outputs"]) == (0, 2)
    assert (by["vllm"]["wrong_outputs"], by["vllm"]["checked_outputs"], by["vllm"]["first_wrong"]) == (1, 3, [1])
    assert by["peft"]["checked_outputs"] is None, "the reference is not checked against itself"
    assert not by["broken"]["ok"] and by["broken"]["reason"] == "could not start"
    assert by["loraplex"]["point"] == "64-zipf-rmixed" and by["loraplex"]["adapters"] == 64
    base = [entry("loraplex", 33.0, None), entry("vllm", 40.0, None)]
    assert base[0]["base_only"] and base[0]["adapters"] == 0 and base[0]["point"] == "base"
    results = base + entries
    report.add_slowdowns(results)
    assert by["vllm"]["slowdown_vs_base"] == 4.0 and by["loraplex"]["slowdown_vs_base"] == 1.1
    assert "slowdown_vs_base" not in by["peft"], "no base run: no slowdown"
    r = report.ratios(results)["64-zipf-rmixed"]
    assert r["loraplex_over_vllm"] == 3.0 and r["loraplex_over_vllm_base"] == 0.75
    assert r["loraplex_over_peft"] == 6.0 and r["vllm_slowdown"] == 4.0 and r["loraplex_slowdown"] == 1.1
    assert "peft_slowdown" not in r
    assert "not run: could not start" in report.table({"results": results, "ratios": {}})
    stalled = report.result_entry("vllm", point, 1.0, {"summary": {"output_tok_s": 0, "finished": 0,
                                                                    "errors": ["timeout"]}})
    assert not stalled["ok"] and "timeout" in stalled["reason"], "a run with nothing finished is not ok"


def test_the_sweep_and_its_adapters(tmp_path):
    peers = _bench_module("peers")
    inputs = _bench_module("peer_inputs")
    args = peers.parse_args(["--sweep"])
    points = peers.sweep_points(args)
    assert len(points) == 5 * 2 * 2 and len({p.key for p in points}) == 20
    assert {p.adapters for p in points} == {1, 8, 64, 256, 1024}
    with pytest.raises(SystemExit):
        peers.parse_args(["--ranks", "0"])
    config = {**_bench_module("model_shapes").shape_config("tiny"), "vocab_size": 64}
    many = inputs.SweepPoint(inputs.DISTINCT + 3, "uniform", "mixed")
    adapters = inputs.adapter_set(tmp_path, config, many)
    assert len(adapters) == inputs.DISTINCT + 3 and len({p.name for p in adapters.values()}) == len(adapters)
    ranks = [int(json.loads((p / "adapter_config.json").read_text())["r"]) for p in adapters.values()]
    assert ranks == [many.rank_of(i) for i in range(len(adapters))] and set(ranks) == set(inputs.MIXED_RANKS)
    first, linked = list(adapters.values())[2], list(adapters.values())[inputs.DISTINCT + 2]
    for f in first.iterdir():  # past DISTINCT: hard links to the adapter of the same rank DISTINCT before
        assert (linked / f.name).stat().st_ino == f.stat().st_ino
    weights = {p: (p / "adapter_model.safetensors").read_bytes() for p in list(adapters.values())[:2]}
    assert len(set(weights.values())) == 2, "the first DISTINCT have weights of their own"
    cold = inputs.cold_set(tmp_path, config, many, 2)
    assert not set(cold) & set(adapters)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the sampler reads /proc (Linux)")
def test_peak_memory_counts_a_child_process_tree(tmp_path):
    memory = _bench_module("proc_memory")
    # A parent whose child touches 200 MiB, then both wait to be killed.
    script = ("import subprocess, sys, time\n"
              "if sys.argv[1:] == ['child']:\n"
              "    block = bytearray(200 * 2**20)\n"
              "    for i in range(0, len(block), 4096): block[i] = 1\n"
              "    open(sys.argv[0] + '.ready', 'w').close(); time.sleep(60)\n"
              "else:\n"
              "    subprocess.Popen([sys.executable, sys.argv[0], 'child']).wait()\n")
    path = tmp_path / "tree.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)])
    try:
        with memory.PeakMemory([parent.pid], interval_s=0.05) as peak:
            deadline = time.monotonic() + 60
            while not (tmp_path / "tree.py.ready").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
        assert len(memory.tree([parent.pid])) == 2
        assert 200 < peak.peak_mb < 400, peak.peak_mb
    finally:
        for pid in memory.tree([parent.pid])[::-1]:
            os.kill(pid, 9)
        parent.wait()


def test_loraplex_settings_reach_the_daemon_as_environment(monkeypatch, tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import peer_systems
        import peers
    finally:
        sys.path.remove(str(BENCH))
    with pytest.raises(SystemExit):
        peers.parse_args(["--loraplex-setting", "overlap=false"])  # no section
    args = peers.parse_args(["--loraplex-setting", "scheduler.overlap=false"])
    assert args.loraplex_setting == ["scheduler.overlap=false"]
    started = []

    class Proc:
        def __init__(self, argv, env, **kwargs):
            started.append((argv, env))

        def poll(self):
            return None

    monkeypatch.setattr(peer_systems.subprocess, "Popen", Proc)
    monkeypatch.setattr(peer_systems, "wait_ready", lambda served, timeout_s: None)
    monkeypatch.setenv("LORAPLEX_MODEL_NUM_PAGES", "7")  # the caller's own settings never leak in
    served = peer_systems.start_loraplex(tmp_path, tmp_path / "m", {}, cores="0", max_rank=8, timeout_s=1,
                                         settings=["scheduler.overlap=false"])
    assert served.settings["scheduler.overlap"] == "false"
    serve_env = started[0][1]
    assert serve_env["LORAPLEX_SCHEDULER_OVERLAP"] == "false" and "LORAPLEX_MODEL_NUM_PAGES" not in serve_env
    assert started[0][0][:3] == ["taskset", "-c", "0"]


def test_the_plot_draws_every_curve_of_the_reports(tmp_path):
    report = _bench_module("peer_report")
    inputs = _bench_module("peer_inputs")
    plot = _bench_module("peers_plot")
    results = [report.result_entry(s, None, 1.0, {"summary": {"output_tok_s": 30.0, "finished": 4}})
               for s in ("loraplex", "peft")]
    for n in (1, 8, 64):
        for system, tok_s in (("loraplex", 29.0 - n / 16), ("peft", 25.0 - n / 8)):
            results.append(report.result_entry(system, inputs.SweepPoint(n, "zipf", "mixed"), 1.0,
                                               {"summary": {"output_tok_s": tok_s, "finished": 4}}))
    results.append(report.result_entry("vllm", inputs.SweepPoint(256, "zipf", "mixed"), 1.0, {"error": "not run"}))
    report.add_slowdowns(results)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": results}))
    assert {k[0] for k in plot.curves(plot.load([path]))} == {"loraplex", "peft"}, "not-run points are not drawn"
    assert [n for n, _ in plot.curves(plot.load([path]))[("peft", "zipf", "mixed")]] == [1, 8, 64]
    assert plot.main([str(path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": results[:2]}))
    assert plot.main([str(empty), "--out", str(tmp_path / "q.png")]) == 1


def test_the_outside_client_reads_vllm_bench_results_into_our_summary(tmp_path):
    outside = _bench_module("peer_outside_client")
    load = outside.OutsideLoad(requests=24, rate=1.0, prompt_len=128, max_tokens=32, seed=5)
    argv = outside.bench_argv(tmp_path / "venv", tmp_path / "bench.py", "http://127.0.0.1:9", tmp_path / "m", load,
                              ["a1", "a2"], tmp_path / "out" / "r.json")
    flags = dict(zip(argv[2::1], argv[3::1]))
    assert flags["--num-prompts"] == "24" and flags["--request-rate"] == "1.0" and flags["--seed"] == "5"
    assert flags["--random-input-len"] == "128" and flags["--random-output-len"] == "32"
    assert "--ignore-eos" in argv and argv[argv.index("--lora-modules") + 1:argv.index("--lora-modules") + 3] == [
        "a1", "a2"]
    assert "--lora-modules" not in outside.bench_argv(tmp_path, tmp_path, "u", tmp_path, load, [], tmp_path / "r")
    saved = {"duration": 30.5, "completed": 23, "num_prompts": 24, "total_output_tokens": 736,
             "output_throughput": 24.13, "p50_ttft_ms": 812.4, "p99_ttft_ms": 2001.0, "p50_tpot_ms": 170.2,
             "p99_tpot_ms": 260.0, "errors": ["", "", "timeout"]}
    s = outside.summary_of(saved)
    assert (s["finished"], s["failed"], s["output_tokens"], s["output_tok_s"]) == (23, 1, 736, 24.13)
    assert (s["ttft_ms_p50"], s["ttft_ms_p99"], s["tpot_ms_p50"], s["tpot_ms_p99"]) == (812.4, 2001.0, 170.2, 260.0)
    assert s["errors"] == ["timeout"]
    with pytest.raises(_bench_module("peer_systems").PeerUnavailable, match="--setup"):
        outside.run_vllm_bench(tmp_path / "none", tmp_path, "http://x/v1/completions", tmp_path, load, [], 5)


def test_a_text_that_leaves_pefts_at_a_near_tie_or_a_seam_is_told_apart_from_a_wrong_one():
    report = _bench_module("peer_report")
    point = _bench_module("peer_inputs").SweepPoint(8, "zipf", "mixed")
    vocab = "abcdefg\ufffd"  # id 7 prints as a lone byte (U+FFFD on its own)
    reference = report.Reference(token_ids={0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 0], 3: [1, 2, 3],
                                            4: [7, 1, 2]},
                                 margins={0: [0.5, 1e-5, 0.3], 1: [0.5, 0.02, 0.3], 2: [0.1, 0.1, 0.1],
                                          3: [0.4, 0.4, 0.4], 4: [0.4, 0.4, 0.4]},
                                 decode=lambda ids: "".join(vocab[i] for i in ids), tolerance=1e-4)
    assert reference.divergence(0, "abc") == (None, None)
    assert reference.divergence(0, "abX") == (2, 0.3) and reference.divergence(0, "aX") == (1, 1e-5)
    entries = [report.result_entry("vllm", point, 1.0, {"summary": {"output_tok_s": 1.0, "finished": 4}})]
    # request 0 leaves PEFT's at a margin of 1e-5 (under 2 x 1e-4): a near-tie; request 1 at 0.02 on a
    # whole token past the first: wrong; request 2 at a lone byte, 4 just after one, 3 at its first token: seams
    report.check_texts(entries, _outputs(report, {"peft": {0: "abc", 1: "def", 2: "g\ufffda", 3: "bcd", 4: "\ufffdbc"},
                                                  "vllm": {0: "aXY", 1: "dZf", 2: "gZa", 3: "Zcd", 4: "\ufffdZc"}}),
                       reference)
    e = entries[0]
    assert (e["checked_outputs"], e["wrong_outputs"], e["near_tie_outputs"], e["seam_outputs"]) == (5, 1, 1, 3)
    assert e["first_wrong"] == [1]
    assert [(d["index"], d["token"], d["kind"]) for d in e["divergences"]] == [
        (0, 1, "near_tie"), (1, 1, "wrong"), (2, 1, "seam"), (3, 0, "seam"), (4, 1, "seam")]
    without = [report.result_entry("vllm", point, 1.0, {"summary": {"output_tok_s": 1.0, "finished": 3}})]
    report.check_texts(without, _outputs(report, {"peft": {0: "abc", 1: "def"}, "vllm": {0: "aXY", 1: "dZf"}}))
    assert without[0]["wrong_outputs"] == 2, "no margins known: every differing text counts as wrong"
    # With token ids on both sides the tokens decide, not the texts: request 2's text differs (another
    # detokenizer's spelling) over the same tokens, which is right; request 3's first token differs at a
    # margin of 0.4, which text would have called a seam and ids show is wrong; request 0 stays a near-tie.
    by_ids = [report.result_entry("vllm", point, 1.0, {"summary": {"output_tok_s": 1.0, "finished": 4}})]
    peft = {i: report.Output(text, reference.token_ids[i]) for i, text in
            {0: "abc", 2: "g\ufffda", 3: "bcd"}.items()}
    vllm = {0: report.Output("aXY", [0, 5, 6]), 2: report.Output("g?a", [6, 7, 0]), 3: report.Output("Zcd", [4, 2, 3])}
    report.check_texts(by_ids, {"peft": peft, "vllm": vllm}, reference)
    e = by_ids[0]
    assert (e["checked_outputs"], e["checked_by_token_ids"], e["wrong_outputs"], e["near_tie_outputs"],
            e["seam_outputs"]) == (3, 3, 1, 1, 0)
    assert [(d["index"], d["token"], d["kind"]) for d in e["divergences"]] == [(0, 1, "near_tie"), (3, 0, "wrong")]


def _outputs(report, texts: dict[str, dict[int, str]]) -> dict[str, dict[int, object]]:
    return {system: {i: report.Output(text) for i, text in by_index.items()} for system, by_index in texts.items()}


def test_cold_probes_never_share_a_prefix_with_each_other_or_the_workload():
    peers = _bench_module("peers")
    requests = workload(requests=5, prompt_len=12, vocab=(3, 1000))
    prompts = peers.probe_prompts(requests, 8)
    firsts = {tuple(p[:1]) for p in prompts} | {tuple(r.prompt[:1]) for r in requests}
    assert len(prompts) == 8 and all(len(p) == 12 for p in prompts)
    assert len({tuple(p) for p in prompts} | {tuple(r.prompt) for r in requests}) == 8 + 5
    assert all(p[0] != requests[0].prompt[0] for p in prompts), "a cached first page would flatter the probe"
    assert len(firsts) >= 8


def test_the_client_reads_token_ids_only_where_every_token_is_named_by_its_id():
    workload = _bench_module("peer_workload")
    assert workload.token_ids(["token_id:5", "token_id:70"]) == [5, 70]
    assert workload.token_ids(["token_id:5", "abc"]) is None, "a server that spells tokens as text"
    assert workload.token_ids(["token_id:x"]) is None and workload.token_ids([]) is None
