"""bench/peers.py's parts that need no peer installed: the seeded workload, the open-loop
streaming client against a real loopback HTTP server, the summary, the text comparison and the
ratios. (The side-by-side run itself needs vLLM's venv: bench/README.md.)"""
from __future__ import annotations

import asyncio
import json
import sys
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


def test_texts_are_compared_with_peft_and_ratios_taken_against_loraplex():
    sys.path.insert(0, str(BENCH))
    try:
        import peers
    finally:
        sys.path.remove(str(BENCH))
    runs = {"loraplex": {"texts": {0: "x", 1: "y"}}, "vllm": {"texts": {0: "x", 1: "z", 2: "w"}},
            "peft": {"texts": {0: "x", 1: "y", 2: "w"}}, "broken": {"error": "could not start"}}
    peers.compare_texts(runs)
    assert runs["loraplex"]["agree_with_peft"] == {"compared": 2, "differ": 0, "first_differing": []}
    assert runs["vllm"]["agree_with_peft"] == {"compared": 3, "differ": 1, "first_differing": [1]}
    assert "agree_with_peft" not in runs["broken"]
    tok = {"adapters": {"loraplex": 30.0, "vllm": 10.0, "peft": 5.0}, "base": {"loraplex": 33.0, "vllm": 40.0}}
    report = {"runs": {kind: {name: {"summary": {"output_tok_s": v}} for name, v in by.items()}
                       for kind, by in tok.items()}}
    r = peers.ratios(report)
    assert r["loraplex_adapters_over_vllm_adapters"] == 3.0 and r["loraplex_adapters_over_vllm_base"] == 0.75
    assert r["loraplex_adapters_over_peft_adapters"] == 6.0
    assert r["vllm_slowdown_adapters"] == 4.0 and r["loraplex_slowdown_adapters"] == 1.1
    assert "peft_slowdown_adapters" not in r, "no base run: no slowdown"


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
