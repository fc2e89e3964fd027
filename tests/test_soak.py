"""Bounded soak: bench/soak.py drives a real daemon (CPU demo model,
cpu_assist, cache policy none) with concurrent clients that stream, cancel and
reconnect, and the daemon's process tree keeps flat fds and shared-memory
segments and bounded RSS. The script runs as a user would run it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_env import user_env

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


def soak(*args: str, timeout: float) -> dict:
    out = subprocess.run([sys.executable, str(SOAK), "--json", *args], capture_output=True, text=True,
                         timeout=timeout, check=False, env=user_env())
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["daemon_exit_status"] == 0, report["daemon_log_tail"]
    assert report["shm_segments_after_exit"] == [], "the daemon left shared-memory segments behind"
    requests = report["requests"]
    assert requests["failed"] == 0, requests["errors"]
    return report


def test_short_soak_leaks_no_fds_or_segments(demo):
    # Load for ~5 s; a new connection every 2 requests, so a per-connection or per-request
    # fd leak shows up even in a handful of requests.
    report = soak("--clients", "2", "--minutes", "0.08", "--max-tokens", "4", "--reconnect-every", "2",
                  "--sample-s", "0.5", "--settle-s", "1", timeout=240)
    m = report["metrics"]
    assert report["requests"]["total"] >= 20  # >= 10 new connections: a leak per connection would show
    assert m["shm_segments"]["initial"] == m["shm_segments"]["end"] == m["shm_segments"]["max"]
    # one-time lazy opens after ready (the children's background work: the host tier's warm-up,
    # their parent watchers), not one per request or connection
    assert m["fds"]["end"] <= m["fds"]["initial"] + 4, m["fds"]
    assert m["processes"]["end"] == m["processes"]["initial"]


@pytest.mark.slow
def test_soak_keeps_fds_shm_flat_and_rss_bounded(demo):
    report = soak("--clients", "4", "--minutes", "0.45", "--reconnect-every", "5", "--sample-s", "1",
                  "--warmup-s", "8", timeout=600)
    m, requests = report["metrics"], report["requests"]
    assert requests["total"] >= 8 and requests["cancelled"] >= 1, requests
    assert m["shm_segments"]["initial"] == m["shm_segments"]["end"] == m["shm_segments"]["max"]
    assert m["fds"]["end"] <= m["fds"]["initial"] + 2, m["fds"]
    assert m["fds"]["max"] <= m["fds"]["initial"] + 4 * 4, m["fds"]  # at most a few per live client connection
    assert m["threads"]["end"] <= m["threads"]["initial"] + 2, m["threads"]
    assert m["rss_mib"]["end"] - m["rss_mib"]["start"] < 64, m["rss_mib"]
