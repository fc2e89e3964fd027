"""What an operator meets on a real daemon (cpu_assist, two CPU LoRA workers, six
requests running), `loraplex stats` prints a short summary (`--json` the whole
document), `loraplex policy get` prints the policies in use, and `loraplex top`, fed the
daemon's own stats document through Textual's run_test pilot, shows the live step time
and batch on the engine row, the CPU workers, and every request in flight. Mistakes an
operator makes (a second serve on the same runtime or state directory, an unsupported
model, a path-traversal adapter name) get one line, not a traceback."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time

import pytest

from loraplex.cli import main as cli_main
from loraplex.tui.app import LoraplexTop
from loraplex.tui.feed import QueueFeed
from tests.daemon_process import DaemonProcess
from tests.test_tui_support import FakeAdmin

ADAPTERS = ["all-r32", "qv-r8", None]


@pytest.fixture(scope="module")
def busy(demo, tmp_path_factory):
    """The daemon, and its stats document taken while six long requests all run."""
    daemon = DaemonProcess(tmp_path_factory.mktemp("operator"), "--adapter-load-mode", "cpu_assist",
                           "--cpu-workers", "2").start()
    client = daemon.client()
    ids = [f"req-{i}-{random.randrange(16**6):06x}" for i in range(6)]
    streams = [client.stream([random.randrange(5, 200) for _ in range(24)], adapter=ADAPTERS[i % 3],
                             max_tokens=2000, ignore_eos=True, temperature=0.0, request_id=rid)
               for i, rid in enumerate(ids)]
    try:
        deadline = time.monotonic() + 60
        while True:
            stats = client.stats()
            if stats["running"] == 6 and all(e["step_ms"] for e in stats["engines"]):
                break
            assert time.monotonic() < deadline, f"six requests never ran together: {stats['running']}"
            time.sleep(0.02)
        yield daemon, stats, ids
    finally:
        for stream in streams:
            stream.close()
        client.close()
        assert daemon.stop() == 0, daemon.log()


def test_the_stats_document_has_what_the_console_shows(busy) -> None:
    _, stats, ids = busy
    (engine,) = stats["engines"]
    assert engine["batch_rows"] == 6 and engine["step_ms"] > 0
    assert stats["in_flight_total"] == 6
    assert sorted(r["id"] for r in stats["in_flight"]) == sorted(ids)
    assert {r["state"] for r in stats["in_flight"]} <= {"prefill", "decode"}
    assert [r["adapter"] for r in sorted(stats["in_flight"], key=lambda r: r["id"])] == ADAPTERS * 2
    assert len(stats["workers"]) == 2 and stats["cache_policy"] == stats["cache"]["policy"]


def _screen(stats: dict) -> dict[str, str]:
    """Each panel's text once the console has drawn `stats` (at 120x50: room for every row)."""
    feed = QueueFeed()
    app = LoraplexTop(feed, FakeAdmin(adapters=[]), target="/run/lpx", adapters_poll_s=60.0)
    panels: dict[str, str] = {}

    async def main() -> None:
        async with app.run_test(size=(120, 50)) as pilot:
            feed.snapshot(stats)
            deadline = asyncio.get_running_loop().time() + 5.0
            while feed.pending and asyncio.get_running_loop().time() < deadline:
                await pilot.pause(0.02)
            await pilot.pause()
            for panel_id in ("engines", "workers", "inflight"):
                panels[panel_id] = app.panel(panel_id).plain_text()

    asyncio.run(main())
    return panels


def test_top_shows_the_live_engine_row_the_workers_and_the_requests(busy) -> None:
    _, stats, ids = busy
    panels = _screen(stats)
    row = next(line for line in panels["engines"].splitlines() if line.startswith("0 "))
    cells = row.split()
    assert cells[:2] == ["0", "up"] and cells[2].endswith("ms") and cells[3] == "6.0", row  # not "—"
    workers = panels["workers"]
    assert "workers 2" in workers and "n/a" not in workers
    for worker in stats["workers"]:
        assert str(worker["pid"]) in workers
    listed = panels["inflight"]
    assert "request" in listed and "adapter" in listed and "state" in listed and "tokens" in listed
    for rid in ids:
        assert rid in listed, listed
    assert listed.count("all-r32") == 2 and listed.count("<base>") == 2


def test_stats_prints_a_summary_and_json_on_request(busy, capsys: pytest.CaptureFixture[str]) -> None:
    daemon, _, _ = busy
    assert cli_main(["stats", "--runtime-dir", str(daemon.runtime_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert 6 <= len(lines) <= 14, lines  # was 234 lines of JSON
    labels = [line.split()[0] for line in lines[:-1]]
    assert labels[:6] == ["daemon", "requests", "latency", "engines", "pool", "gpu"]
    assert "cpu" in labels and lines[-1] == "(the full document: loraplex stats --json)"
    assert "scheduler fcfs" in lines[0] and "loads cpu_assist" in lines[0]
    assert "1/1 up" in lines[3] and "2/2 workers up" in next(line for line in lines if line.startswith("cpu"))
    assert cli_main(["stats", "--json", "--runtime-dir", str(daemon.runtime_dir)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert {"latency", "engines", "workers", "in_flight", "pool"} <= set(document)


def test_policy_get_prints_the_policies_in_use(busy, capsys: pytest.CaptureFixture[str]) -> None:
    daemon, _, _ = busy
    runtime = ["--runtime-dir", str(daemon.runtime_dir)]
    for argv in (["policy", "get", *runtime], ["policy", *runtime, "get"]):  # either place
        assert cli_main(argv) == 0
        assert capsys.readouterr().out.splitlines() == ["scheduler: fcfs", "cache: lru", "router: most_idle"]
    try:
        assert cli_main(["policy", "set", "cache", "cost", *runtime]) == 0
        assert cli_main(["policy", "set", "scheduler", "mlq", *runtime]) == 0
        capsys.readouterr()
        assert cli_main(["policy", "get", *runtime]) == 0
        assert capsys.readouterr().out.splitlines() == ["scheduler: mlq", "cache: cost", "router: most_idle"]
    finally:  # the daemon is shared by this module's tests
        assert cli_main(["policy", "set", "cache", "lru", *runtime]) == 0
        assert cli_main(["policy", "set", "scheduler", "fcfs", *runtime]) == 0


def _serve(*args: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_a_second_serve_on_a_busy_runtime_directory_is_one_line(busy, tmp_path) -> None:
    daemon, _, _ = busy
    proc = _serve("serve", env={**daemon.env, "LORAPLEX_STATE_DIR": str(tmp_path / "state")})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"loraplex serve: error: a daemon already serves {daemon.runtime_dir} (another process is listening on "
        f"{daemon.runtime_dir / 'client.sock'}); stop it first, or give this one another --runtime-dir")
    proc = _serve("serve", env=daemon.env)  # its state directory too: the state lock answers first
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        f"loraplex serve: error: state directory {daemon.state_dir} is in use by another loraplex daemon serving "
        f"this base model (pid {daemon.proc.pid}); stop it first, or give this one another --state-dir"], proc.stderr
    with daemon.client() as client:
        assert client.ping(timeout=5.0) >= 0  # the first daemon is untouched


def test_an_unsupported_model_type_is_one_line(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    kind = random.choice(["bloom", "falcon", "mamba"])
    (model / "config.json").write_text(json.dumps({"model_type": kind, "hidden_size": 64}))
    env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(tmp_path / "rt"), "LORAPLEX_STATE_DIR": str(tmp_path / "state")}
    proc = _serve("serve", "--model", str(model), env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    # The child says why in one line, and the daemon passes the reason on (not "exited with status 2").
    assert f"the engine could not start: cache manager failed to start: unsupported model_type '{kind}'" \
        in proc.stderr, proc.stderr


def test_a_path_traversal_adapter_name_is_one_line(busy, demo, tmp_path, capsys) -> None:
    daemon, _, _ = busy
    name = random.choice(["../../etc", "../x", "a/../b"])
    runtime = ["--runtime-dir", str(daemon.runtime_dir)]
    for argv in (["adapters", *runtime, "add", name, str(demo.adapters["qv-r8"])], ["adapters", *runtime, "rm", name]):
        assert cli_main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("loraplex adapters: error: [invalid_field] name: must be 1..128 chars") and \
            err.count("\n") == 1, err
    env = {**os.environ, "LORAPLEX_RUNTIME_DIR": str(tmp_path / "rt"), "LORAPLEX_STATE_DIR": str(tmp_path / "state")}
    proc = _serve("serve", "--adapter", f"{name}={demo.adapters['qv-r8']}", env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr


# -- `loraplex adapters` with no daemon (issue 31.8) ------------------------------------------------

def _place(tmp_path) -> list[str]:
    """A runtime directory no daemon listens in, and a fresh registry."""
    return ["--runtime-dir", str(tmp_path / "rt"), "--state-dir", str(tmp_path / "state")]


def test_adapters_take_the_runtime_and_state_dirs_after_the_action_too(tmp_path, monkeypatch, capsys) -> None:
    from loraplex.contracts.demo import trained_demo_dir

    monkeypatch.setenv("LORAPLEX_DEMO", "trained")
    runtime, state = _place(tmp_path)[:2], _place(tmp_path)[2:]
    assert cli_main(["adapters", "add", "mine", str(trained_demo_dir() / "adapters" / "amen"), *runtime, *state]) == 0
    assert capsys.readouterr().out.startswith("added mine")
    outputs = []
    for argv in (["adapters", *runtime, *state, "list"], ["adapters", "list", *runtime, *state],
                 ["adapters", *state, "list", *runtime]):  # before, after, and one of each
        assert cli_main(argv) == 0, argv
        outputs.append(capsys.readouterr())
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0].err.startswith(f"no loraplex daemon is running in {tmp_path / 'rt'}: "), outputs[0].err
    assert "mine\trank=16\tregistered\t-\t" in outputs[0].out  # its real rank, though the registry has none yet
    assert cli_main(["adapters", "rm", "mine", *runtime, *state]) == 0


@pytest.mark.parametrize("kind", ["trained", "random"])
def test_adapters_list_without_a_daemon_shows_the_demo_adapters_and_their_ranks(kind, request, tmp_path,
                                                                                  monkeypatch, capsys) -> None:
    from loraplex.contracts.demo import trained_demo_dir

    monkeypatch.setenv("LORAPLEX_DEMO", kind)
    if kind == "trained":
        root, ranks = trained_demo_dir(), {"amen": 16, "reverse": 16, "upper": 16}  # README: rank 16
    else:
        from loraplex.gpu_engine.demo import DEMO_ADAPTERS

        root, ranks = request.getfixturevalue("demo").root, {spec.name: spec.rank for spec in DEMO_ADAPTERS}
    assert cli_main(["adapters", "list", *_place(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0].startswith(f"no loraplex daemon is running in {tmp_path / 'rt'}: the registry's "
                                          "adapters and the built-in demo's"), err
    assert out.splitlines() == [f"{name}\trank={rank}\tbuilt-in\t-\t{root / 'adapters' / name}"
                                for name, rank in sorted(ranks.items())]
    # A registered adapter of a demo adapter's name is the one served (and listed), as at start.
    shadow = sorted(ranks)[0]
    assert cli_main(["adapters", "add", shadow, str(root / "adapters" / sorted(ranks)[-1]), *_place(tmp_path)]) == 0
    capsys.readouterr()
    assert cli_main(["adapters", *_place(tmp_path), "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{shadow}\trank={ranks[sorted(ranks)[-1]]}\tregistered\t")
    assert len(lines) == len(ranks) and sum("\tbuilt-in\t" in line for line in lines) == len(ranks) - 1


def test_adapters_list_of_the_demo_needs_no_engine_side(tmp_path, monkeypatch) -> None:
    """On the light install (no torch) the demo's adapters are listed too."""
    from tests.test_packaging import without_engine

    monkeypatch.setenv("LORAPLEX_DEMO", "trained")
    proc = without_engine("import sys; from loraplex.cli import main; sys.exit(main(sys.argv[1:]))",
                          "adapters", "list", *_place(tmp_path))
    assert proc.returncode == 0 and "no loraplex daemon is running" in proc.stderr, proc.stderr
    assert [line.split("\t")[:3] for line in proc.stdout.splitlines()] == [
        ["amen", "rank=16", "built-in"], ["reverse", "rank=16", "built-in"], ["upper", "rank=16", "built-in"]]
