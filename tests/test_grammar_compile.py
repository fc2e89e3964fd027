"""Structured output never compiles in an engine's step (issue 31, point 1): a grammar is
checked first by a compile worker process (killed once it used server.grammar_compile_timeout_s
of CPU time, its memory capped) while its request waits, then compiled by its engine off the
step; nesting is bounded before any parser runs. A client sending a deeply nested or slow schema
gets `grammar_too_complex` while another client's stream goes on without a gap, the engine is
never restarted, and a repeated schema is answered from the cache."""
from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import zmq

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.daemon.scheduler.grammar_book import GrammarBook
from loraplex.ipc.client import Client, Guided, LoraplexError
from loraplex.ipc.codec import decode
from loraplex.ipc.engine_plan import MAX_GUIDED_DEPTH, MAX_GUIDED_SPEC, GrammarOrder, SamplingSpec
from loraplex.ipc.errors import ErrorCode, ProtocolError
from loraplex.ipc.guided import GrammarTooComplex, check_guided, grammar_key, nesting_depth
from loraplex.ipc.protocol import PROTOCOL_VERSION, GenerateRequest, GrammarCompile
from tests.daemon_process import DaemonProcess

MAX_GAP_S = 0.5
SIMPLE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def nested(levels: int, extra: int = 0) -> str:
    """An object schema `levels` deep, each level with `extra` string properties beside the next."""
    names = ["a", *(f"x{j}" for j in range(extra))]
    siblings = "".join(f',"{name}":{{"type":"string"}}' for name in names[1:])
    required = json.dumps(names, separators=(",", ":"))
    schema = '{"type":"string"}'
    for _ in range(levels):  # as text: json.dumps of a dict this deep overflows Python's stack
        schema = f'{{"type":"object","properties":{{"a":{schema}{siblings}}},"required":{required}}}'
    return schema


# Shallow and tiny (616 bytes), yet ~9 s of CPU time to compile on the CPU demo's vocabulary: past
# the test daemon's 2 s limit (no depth bound catches it). FAST takes ~0.25 s: within it. WIDE_DEEP
# (127 levels of JSON, 58 KB) takes ~3 s and tens of MiB.
_PATTERNS = {f"p{i}": {"type": "string", "pattern": "^([a-z]{1,100}-){1,%d}$" % (100 + i)} for i in range(8)}
SLOW = json.dumps({"type": "object", "properties": _PATTERNS, "required": list(_PATTERNS)})
FAST = nested(60, extra=4)
WIDE_DEEP = nested(63, extra=30)


def test_nesting_is_bounded_before_any_parser_sees_the_spec():
    for levels in (330, 480):
        spec = nested(levels)
        assert len(spec) < MAX_GUIDED_SPEC
        with pytest.raises(GrammarTooComplex, match=f"nests {2 * levels + 1} levels deep; the limit is "
                                                     f"{MAX_GUIDED_DEPTH}"):
            check_guided("json_schema", spec)
        with pytest.raises(ProtocolError) as info:
            GenerateRequest(request_id="r", prompt="x", guided_kind="json_schema", guided_spec=spec)
        assert info.value.code is ErrorCode.GRAMMAR_TOO_COMPLEX
    for spec in (SLOW, FAST, WIDE_DEEP, json.dumps(SIMPLE)):
        check_guided("json_schema", spec)
    # Strings and character classes do not nest; escapes do not open groups.
    assert nesting_depth("json_schema", json.dumps({"a": ["[[{{", {"b": "\\\"]"}]})) == 3
    assert nesting_depth("regex", r"((a)\(b[()]\))") == 2 and nesting_depth("regex", r"[]()]x") == 0
    # Linear on hostile input (no backtracking, no recursion): what json.loads would choke on.
    started = time.perf_counter()
    for spec in ("[" * MAX_GUIDED_SPEC, '"' + '\\"' * (MAX_GUIDED_SPEC // 2 - 1), '["' * (MAX_GUIDED_SPEC // 2)):
        with pytest.raises(ValueError):
            check_guided("json_schema", spec)
    for spec in ("(" * MAX_GUIDED_SPEC, "[\\" * (MAX_GUIDED_SPEC // 2)):
        nesting_depth("regex", spec)
    assert time.perf_counter() - started < 2.0


def test_grammar_book_orders_once_and_waits_only_while_others_run():
    book = GrammarBook(limit=2)
    guided = SamplingSpec(guided_kind="regex", guided_spec="[a-z]+")
    assert not book.must_wait(SamplingSpec(), busy=True)
    assert book.must_wait(guided, busy=True) and book.must_wait(guided, busy=True)
    assert book.take_orders() == [GrammarOrder("regex", "[a-z]+")] and book.take_orders() == []
    assert not book.must_wait(guided, busy=False)  # alone: admitted at once (its step waits for the compile)
    book.lost()  # the plan that carried the order was refused: ordered again
    assert book.must_wait(guided, busy=True) and len(book.take_orders()) == 1
    book.reported([grammar_key("regex", "[a-z]+"), "not-ordered"])
    assert not book.must_wait(guided, busy=True) and book.take_orders() == []
    assert list(book.compiled) == [grammar_key("regex", "[a-z]+")]


class _FakeWorker:
    """A compile worker link: `verdicts` maps a spec to its verdict; each call takes `delay_s`."""

    def __init__(self, index: int, verdicts: dict[str, str], delay_s: float = 0.0, fail_start: bool = False):
        self.index, self.pid, self.hello = index, 1000 + index, None
        self.verdicts, self.delay_s, self.fail_start = verdicts, delay_s, fail_start
        self.calls: list[str] = []

    def alive(self) -> bool:
        return self.hello is not None

    async def start(self):
        if self.fail_start:
            from loraplex.daemon.child_link import EngineDied

            raise EngineDied("grammar compiler failed to start: No module named 'xgrammar'")
        self.hello = object()

    async def call(self, order, timeout_s=None):
        from loraplex.ipc.protocol import GrammarCompiled

        self.calls.append(order.spec)
        await asyncio.sleep(self.delay_s)
        return GrammarCompiled(verdict=self.verdicts.get(order.spec, "ok"), message="why", seconds=self.delay_s)

    async def stop(self):
        self.hello = None


def _gate(workers: int = 1, **fake):
    from loraplex.daemon.config import ServerSettings
    from loraplex.daemon.grammar_gate import GrammarGate

    links: list[_FakeWorker] = []

    def make(index: int) -> _FakeWorker:
        links.append(_FakeWorker(index, **fake))
        return links[-1]

    return GrammarGate(ServerSettings(grammar_compile_workers=workers), make), links


def test_the_gate_compiles_each_grammar_once_and_remembers_the_verdict():
    async def scenario():
        gate, (worker,) = _gate(verdicts={"slow": "too_complex", "bad": "invalid"}, delay_s=0.05)
        shared = await asyncio.gather(*(gate.check("json_schema", "a") for _ in range(5)))  # one compile, shared
        assert all(v.code is None for v in shared) and worker.calls == ["a"]
        assert (await gate.check("json_schema", "slow")).code is ErrorCode.GRAMMAR_TOO_COMPLEX
        assert (await gate.check("regex", "bad")).code is ErrorCode.INVALID_FIELD
        assert gate.known("json_schema", "slow") and not gate.known("json_schema", "new")
        assert (await gate.check("json_schema", "slow")).message == "why" and worker.calls == ["a", "slow", "bad"]
        assert (await gate.check("json_object", "")).code is None  # one fixed grammar: never compiled
        assert gate.snapshot()["compiles"] == 3 and gate.snapshot()["cache_hits"] == 5
        await gate.stop()

    asyncio.run(scenario())


def test_a_worker_that_cannot_start_fails_requests_at_once_for_a_while():
    async def scenario():
        gate, (worker,) = _gate(verdicts={}, fail_start=True)
        first = await gate.check("json_schema", "a")
        assert first.code is ErrorCode.ENGINE_FAILED and "xgrammar" in first.message
        worker.fail_start = False  # not tried again at once: the failure is remembered (RETRY_START_S)
        assert (await gate.check("json_schema", "b")).code is ErrorCode.ENGINE_FAILED and worker.calls == []
        assert not gate.known("json_schema", "a")  # never cached as the grammar's verdict

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def grammars(demo):
    pytest.importorskip("xgrammar")
    from loraplex.gpu_engine.grammar import Grammars
    from loraplex.gpu_engine.model.config import ModelConfig

    config = ModelConfig.from_dir(demo.model_dir)
    return Grammars(Path(demo.model_dir) / "tokenizer.json", config.vocab_size, config.eos_token_ids)


def test_the_engine_compiles_an_ordered_grammar_off_its_thread(grammars):
    """xgrammar releases the GIL while it compiles: the step's thread runs on (gaps of a few ms,
    where holding the GIL would stall it for the whole compile) while an ordered grammar compiles
    for ~0.2-1 s, and the step result then lists it."""
    for extra in (0, 4, 12, 30):  # wider until the compile lasts long enough to measure on this CPU
        order = GrammarOrder("json_schema", nested(100, extra) + " ")  # a spec no other test compiled
        started = last = time.perf_counter()
        grammars.start([order])
        gaps = []
        while not grammars.take_ready():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        took = time.perf_counter() - started
        if took > 0.2:
            break
    assert took > 0.2, "even the widest schema compiled too quickly to measure anything"
    assert max(gaps) < 0.25 * took, f"the step's thread stalled {max(gaps):.3f} s of a {took:.3f} s compile"
    started = time.perf_counter()
    grammars.compile(order.kind, order.spec)  # compiled: from the cache
    assert time.perf_counter() - started < 0.05
    grammars.start([order])  # ordered again (a refused plan): ready at once
    assert grammars.take_ready() == [grammar_key(order.kind, order.spec)]


def test_the_worker_kills_a_slow_compile_and_caps_its_memory(demo):
    pytest.importorskip("xgrammar")
    from loraplex.gpu_engine.grammar_worker import GrammarWorker

    worker = GrammarWorker(EngineSpec(model=str(demo.model_dir)))

    def compile_(spec: str, kind: str = "json_schema", timeout_s: float = 30.0, memory_mb: int = 1024):
        return worker.compile(GrammarCompile(kind=kind, spec=spec, timeout_s=timeout_s, memory_bytes=memory_mb << 20))

    assert compile_(json.dumps(SIMPLE)).verdict == "ok"
    bad = compile_("(ab", kind="regex")
    assert bad.verdict == "invalid" and "parenthesis" in bad.message
    before = os.times()
    slow = compile_(SLOW, timeout_s=0.5)
    assert slow.verdict == "too_complex" and "within 0.5 s" in slow.message, slow
    # Killed at its limit, not run to the end (~9 s of CPU): counted in CPU time, which the reaped
    # child reports whatever the host's load (wall time on a busy 2-core host is several times it).
    after = os.times()
    used = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    assert used < 1.5, f"the compile ran {used:.2f} s of CPU time past its 0.5 s limit"
    assert compile_(FAST).verdict == "ok"  # the worker itself is unharmed


def test_the_worker_caps_a_compile_s_memory(demo):
    """In a fresh worker process, as the daemon starts it: the cap counts address space beyond the
    worker's, so a process whose heap has room to spare (this test's) would compile within it."""
    pytest.importorskip("xgrammar")
    script = (
        "import json, sys\n"
        "from loraplex.contracts.engine_spec import EngineSpec\n"
        "from loraplex.gpu_engine.grammar_worker import GrammarWorker\n"
        "from loraplex.ipc.protocol import GrammarCompile\n"
        "worker = GrammarWorker(EngineSpec(model=sys.argv[1]))\n"
        "for mb in (1, 1024):\n"
        "    order = GrammarCompile(kind='json_schema', spec=sys.argv[2], timeout_s=60.0, memory_bytes=mb << 20)\n"
        "    reply = worker.compile(order)\n"
        "    print(json.dumps([reply.verdict, reply.message]))\n")
    out = subprocess.run([sys.executable, "-c", script, str(demo.model_dir), WIDE_DEEP], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (hungry, hungry_why), (fed, _) = (json.loads(line) for line in out.stdout.splitlines())
    assert hungry == "too_complex" and "more than 1 MiB" in hungry_why  # it needs tens of MiB
    assert fed == "ok"


def _raw_generate(runtime_dir: Path, spec: str) -> dict:
    """A generate sent as raw msgpack, past the client library's own checks (which refuse a deep
    spec before sending): the daemon must refuse it itself."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{runtime_dir}/client.sock")
    try:
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "request_id": uuid.uuid4().hex,
                                 "prompt": "x", "max_tokens": 4, "guided_kind": "json_schema", "guided_spec": spec}))
        assert sock.poll(30_000), "no reply"
        return decode(sock.recv_multipart()[-1]).to_fields()
    finally:
        sock.close()


def _refused(client: Client, spec: str) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(LoraplexError) as info:
        client.generate("x", max_tokens=4, guided=Guided.json(spec), timeout=60)
    return info.value.code.value, time.monotonic() - started


@pytest.fixture(scope="module")
def daemon(demo, tmp_path_factory):
    pytest.importorskip("xgrammar")
    proc = DaemonProcess(tmp_path_factory.mktemp("grammar"), "--grammar-compile-timeout-s", "2").start()
    yield proc
    assert proc.stop() == 0, proc.log()


def _stream_gaps(client: Client, window) -> list[float]:
    """The gaps (s) between a greedy stream's tokens while `window()` runs, smallest first (the
    window's ends count as tokens: a stall until it closes shows). The test process's heap is
    frozen meanwhile: a full collection of it paused the timestamping thread (bench/flood_gap.py)."""
    gc.collect()
    gc.freeze()
    try:
        return _gaps_while(client, window)
    finally:
        gc.unfreeze()


def _gaps_while(client: Client, window) -> list[float]:
    times: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        with client.stream([11, 12, 13, 14], max_tokens=4000, temperature=0.0, ignore_eos=True, timeout=300) as s:
            for chunk in s:
                if chunk.token_ids:
                    times.append(time.monotonic())
                    started.set()
                if stop.is_set():
                    break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "the stream never started"
    since = time.monotonic()
    try:
        window()
    finally:
        until = time.monotonic()
        stop.set()
        thread.join(60)
    marks = [since, *(t for t in times if since < t < until), until]
    return sorted(b - a for a, b in zip(marks, marks[1:]))


def test_a_deep_or_slow_schema_never_stalls_another_stream(daemon):
    with daemon.client() as client:
        # The first guided request starts the compile worker (imports): not what is measured.
        first = client.generate("Numbers:", max_tokens=20, temperature=0.0, guided=Guided.json(SIMPLE), timeout=120)
        assert json.loads(first.text)["n"] in range(10), first.text
        before = client.stats()
        outcomes: dict[str, object] = {}

        def send_hostile_schemas() -> None:
            for levels in (330, 480):  # refused before any parser runs
                reply = _raw_generate(daemon.runtime_dir, nested(levels))
                outcomes[f"deep{levels}"] = reply["code"]
                assert f"the limit is {MAX_GUIDED_DEPTH}" in reply["message"]
            outcomes["slow"] = _refused(client, SLOW)  # killed in the worker at 2 s of CPU time

        gaps = _stream_gaps(client, send_hostile_schemas)
        after = client.stats()
    assert outcomes["deep330"] == outcomes["deep480"] == "grammar_too_complex"
    assert outcomes["slow"][0] == "grammar_too_complex" and outcomes["slow"][1] >= 2.0
    assert gaps[-1] < MAX_GAP_S, f"the stream stalled {gaps[-1]:.3f} s (largest gaps {gaps[-3:]})"
    assert after["engine_restarts"] == before["engine_restarts"] == 0
    assert after["engine"]["pid"] == before["engine"]["pid"]
    assert after["grammars"]["compiles"] == before["grammars"]["compiles"] + 1  # SLOW; the deep ones never got there


def test_a_schema_within_the_limits_waits_for_its_engine_then_is_followed(daemon):
    """Checked by the worker, then queued while the engine compiles it off its step (another
    stream keeps the engine busy, so it waits rather than joining at once), then constrained.
    (Not timed: on a loaded 2-core host any second row in the batch slows the stream's steps.)"""
    with daemon.client() as client:
        before = client.stats()["grammars"]
        fast: dict[str, str] = {}

        def send() -> None:
            fast["text"] = client.generate("x", max_tokens=8, temperature=0.0, guided=Guided.json(FAST),
                                           timeout=120).text

        _stream_gaps(client, send)
        after = client.stats()
    assert fast["text"].replace(" ", "").startswith('{"a":{"'), fast["text"]
    assert after["grammars"]["compiles"] == before["compiles"] + 1 and after["engine_restarts"] == 0


def test_a_repeated_schema_is_answered_from_the_cache(daemon):
    with daemon.client() as client:
        client.generate("x", max_tokens=8, temperature=0.0, guided=Guided.json(SIMPLE), timeout=120)
        _refused(client, SLOW)
        before = client.stats()["grammars"]
        for _ in range(3):
            text = client.generate("Numbers:", max_tokens=20, temperature=0.0, guided=Guided.json(SIMPLE),
                                   timeout=120).text
            assert json.loads(text)["n"] in range(10), text  # still constrained
        code, seconds = _refused(client, SLOW)
        with pytest.raises(LoraplexError) as info:  # token ids: routed without tokenizing, refused all the same
            client.generate([11, 12, 13], max_tokens=4, guided=Guided.json(SLOW), timeout=60)
        after = client.stats()["grammars"]
    assert code == "grammar_too_complex" and seconds < 1.0  # the verdict is remembered: no 2 s compile again
    assert info.value.code is ErrorCode.GRAMMAR_TOO_COMPLEX
    assert after["compiles"] == before["compiles"]
    assert after["cache_hits"] >= before["cache_hits"] + 5
