"""The daemon's CPU-assist driver keeps a step going when a worker dies between the
moment its readiness is read and the moment its job is sent (the engine's per-layer
deadline then covers that worker's rows, as for a stalled worker)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from loraplex.cpu_lora.pool import CpuWorkerError
from loraplex.daemon import cpu_assist_driver as driver_module
from loraplex.daemon.adapter_table import AdapterEntry, AdapterTable


class RacyPool:
    size = 2

    def __init__(self) -> None:
        self.sent: list[int] = []

    def is_ready(self, index: int) -> bool:
        return True  # both look ready when the plan is made ...

    async def submit(self, index: int, job) -> asyncio.Future:
        await asyncio.sleep(0)
        if index == 1:  # ... but worker 1 died before its job went out
            raise CpuWorkerError(index, "unavailable", "worker is not running", job.job_id)
        self.sent.append(index)
        return asyncio.get_running_loop().create_future()

    def describe(self) -> list:
        return []


def test_a_worker_lost_before_submit_is_skipped_and_the_plan_still_returned(monkeypatch):
    slice_ = SimpleNamespace(adapter="a", xrow=0, count=4, cpu_layers=2)
    cpu_plan = SimpleNamespace(plan=SimpleNamespace(cpu=SimpleNamespace(seq=1), rows=[SimpleNamespace(cpu_layers=2)]),
                               slices={0: [slice_], 1: [slice_]})
    monkeypatch.setattr(driver_module, "plan_cpu_assist", lambda *args, **kwargs: cpu_plan)
    monkeypatch.setattr(driver_module, "CpuLoraJob", lambda **fields: SimpleNamespace(**fields))
    monkeypatch.setattr(driver_module, "CpuJobSlice", lambda **fields: SimpleNamespace(**fields))
    hello = SimpleNamespace(exchange=SimpleNamespace(max_tokens=64), store_segment="store", num_layers=2,
                            link_bytes_per_s=1e9)
    pool = RacyPool()
    drv = driver_module.CpuAssistDriver(pool, hello, SimpleNamespace(ranks=[8], tokens_per_s=[100.0]), 2)
    adapters = AdapterTable()
    entry = AdapterEntry(name="a", path="/a", state="ready", rank=8, nbytes=1024, store_entry=object())
    adapters.put(entry)
    plan = SimpleNamespace(place=[SimpleNamespace(name="a")])

    planned = asyncio.run(drv.prepare(plan, adapters))
    assert planned is cpu_plan.plan
    assert pool.sent == [0] and drv.jobs == 1 and drv.submit_failures == 1
    assert drv.snapshot()["submit_failures"] == 1
