"""One client never stalls another: a real daemon on the random demo model
streams to one client while four others send it twenty 3 MB text prompts each (the reported
attack, which gave a 34 s gap and +400 MB). The stream's largest gap between tokens stays
under half a second, every flood request gets a clean error, the daemon stays healthy and small."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from loraplex.ipc.client import Client
from tests.daemon_process import DaemonProcess

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
try:
    from flood_gap import GapStream, frozen_heap, rss_mib, start_flood, warm_up
finally:
    sys.path.remove(str(BENCH))

MAX_GAP_S = 0.5
RSS_GROWTH_MIB = 150  # the unbounded tokenizer grew the daemon by ~400 MB


def test_a_text_prompt_flood_does_not_stall_a_stream(demo, tmp_path: Path) -> None:
    proc = DaemonProcess(tmp_path).start()
    try:
        warm_up(proc.runtime_dir)
        with Client(runtime_dir=proc.runtime_dir) as client:
            rss_before = rss_mib(proc.proc.pid)
            stream = GapStream(client, max_tokens=4000)
            stream.start()
            assert stream.first.wait(60), "the stream never started"
            with frozen_heap():  # the gaps are the daemon's, not this process's garbage collector's
                since = time.monotonic()
                flood = start_flood(f"ipc://{proc.runtime_dir}/client.sock", clients=4, per_client=20,
                                    prompt_bytes=3_000_000, timeout_s=20.0)
                out, _ = flood.communicate(timeout=90)
                time.sleep(0.3)  # a stall right at the flood's end would show as the last gap
                until = time.monotonic()
            stream.stop.set()
            stream.join(30)
            assert stream.error is None, stream.error
            gaps = stream.gaps_ms(since, until)
            outcome = json.loads(out)
            assert max(gaps) < MAX_GAP_S * 1e3, f"largest gap {max(gaps):.0f} ms; flood {outcome}"
            assert len(gaps) > 10, f"the stream produced {len(gaps) - 1} tokens during the flood"
            assert outcome["codes"] == {"prompt_too_long": 80}, outcome
            assert rss_mib(proc.proc.pid) - rss_before < RSS_GROWTH_MIB
            assert client.ping(timeout=5.0) < 5.0
            after = client.generate("Once upon a time", max_tokens=4, temperature=0.0, ignore_eos=True, timeout=30)
            assert len(after.token_ids) == 4
    finally:
        assert proc.stop() == 0, proc.log()
