"""What the daemon's own stats document gives the console (issue 31.8): the MLQ scheduler's
queues as lanes of the Queues panel (none under FCFS: one queue), and no PCIe link figure
from engines without a GPU (the panel says so), against a stub engine."""
from __future__ import annotations

import asyncio
import dataclasses

from bench.stub_engine import StubEngineLink
from loraplex.daemon.config_load import load_config
from loraplex.daemon.serving import ServingCore
from loraplex.ipc.protocol import GenerateRequest
from loraplex.tui.summary import summary_lines
from tests.test_tui_panels import live, render
from tests.test_tui_support import base_snapshot


class CudaStubLink(StubEngineLink):
    """The stub engine, saying it runs on a GPU with a measured 25 GB/s link."""

    async def start(self):
        hello = await super().start()
        self.hello = dataclasses.replace(hello, device="cuda:0", link_bytes_per_s=25e9)
        return self.hello


def _paused_snapshot(policy: str, queued: int, link: type[StubEngineLink] = StubEngineLink) -> dict:
    """The stats document of a paused core holding `queued` requests."""
    async def run() -> dict:
        async def send(identity, msg) -> None:
            pass

        core = ServingCore(load_config(None, env={}, overrides={"scheduler.policy": policy}), link(None, None, {}),
                           send=send)
        await core.start([])
        core.set_paused(True)
        for i in range(queued):
            await core.submit(b"client", GenerateRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7 + i],
                                                         max_tokens=3, ignore_eos=True, temperature=0.0))
        for _ in range(200):
            if core.snapshot()["waiting"] == queued:
                break
            await asyncio.sleep(0.01)
        snapshot = core.snapshot()
        await core.stop()
        return snapshot

    return asyncio.run(run())


def test_the_queues_panel_shows_the_mlq_lanes_of_the_daemon() -> None:
    snapshot = _paused_snapshot("mlq", 5)
    (lane,) = snapshot["queues"]  # one queue until MLQ has seen enough arrivals to fit more
    assert lane["name"] == "q0" and lane["depth"] == 5 and lane["oldest_wait_ms"] >= 0.0
    text = render("queues", live({**base_snapshot(), **snapshot}))
    assert "q0" in text and "per-lane stats n/a" not in text
    fcfs = _paused_snapshot("fcfs", 2)
    assert fcfs["queues"] == []
    assert "per-lane stats n/a" in render("queues", live({**base_snapshot(), **fcfs}))


def test_the_pcie_panel_has_no_link_figure_without_a_gpu() -> None:
    snapshot = _paused_snapshot("fcfs", 0)
    assert snapshot["pcie"]["link_mb_s"] is None and snapshot["pcie"]["utilisation_pct"] is None
    text = render("pcie", live({**base_snapshot(), **snapshot}), width=70)
    assert "no GPU" in text and "link —" not in text and "n/a" not in text
    assert next(line for line in summary_lines(snapshot) if line.startswith("pcie")).endswith("no GPU link")
    gpu = _paused_snapshot("fcfs", 0, CudaStubLink)
    assert gpu["pcie"]["link_mb_s"] == 25_000.0
    text = render("pcie", live({**base_snapshot(), **gpu}), width=70)
    assert "25.0k MB/s" in text and "no GPU" not in text
    assert next(line for line in summary_lines(gpu) if line.startswith("pcie")).endswith("0.0% of the link")
