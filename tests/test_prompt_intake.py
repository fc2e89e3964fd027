"""Prompts are bounded before any work and tokenized off the event loop: the size bound, the
tokenizer threads, each client's byte budget, `max_tokens` against the context, and a request
that is cancelled, disconnected or timed out while its prompt is being tokenized."""
from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest

from bench.stub_engine import StubEngineLink
from loraplex.daemon.config_load import load_config
from loraplex.daemon.detokenizer import load_tokenizer
from loraplex.daemon.intake import NORMALIZER_SLACK, PromptIntake, longest_token_chars
from loraplex.daemon.serving import Rejected, ServingCore
from loraplex.ipc.protocol import DoneReply, ErrorReply, GenerateRequest

MIB = 1 << 20


class GatedTokenizer:
    """Encodes one id per character, each call waiting for `gate`: a tokenizer we can hold busy."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0
        self.finished = threading.Event()

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {"abcd": 0, "e": 1}

    def encode_batch(self, texts: list[str]) -> list[SimpleNamespace]:
        self.calls += 1
        assert self.gate.wait(30), "the test never opened the gate"
        self.finished.set()
        return [SimpleNamespace(ids=[3 + ord(c) % 50 for c in text]) for text in texts]


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij     ") for _ in range(n))


def test_size_bound_refuses_before_tokenizing() -> None:
    tok = GatedTokenizer()
    intake = PromptIntake(tok, max_model_len=100, vocab_size=512, threads=1, max_queued_bytes_per_client=MIB)
    assert intake.token_chars == 4 and intake.max_prompt_chars == 100 * 4 * NORMALIZER_SLACK
    intake.check_text("x" * intake.max_prompt_chars)  # the bound itself passes
    with pytest.raises(Rejected) as refused:
        intake.check_text("x" * (intake.max_prompt_chars + 1))
    assert refused.value.code == "prompt_too_long" and "before tokenizing" in refused.value.message
    assert tok.calls == 0
    intake.close()


def test_the_bound_is_never_below_a_real_prompts_length(demo) -> None:
    """Whatever the text, a prompt the bound lets through may fit, and one it refuses cannot:
    a prompt of exactly max_model_len tokens has at most max_prompt_chars characters."""
    tokenizer = load_tokenizer(demo.model_dir)
    longest = longest_token_chars(tokenizer)
    ids = sorted(range(tokenizer.get_vocab_size()), key=lambda i: -len(tokenizer.id_to_token(i) or ""))[:50]
    text = tokenizer.decode(ids * 20)  # the longest tokens, repeated: the most characters per token
    assert len(text) <= len(tokenizer.encode(text).ids) * longest


def test_encoding_runs_off_the_event_loop(demo) -> None:
    """A prompt that takes the tokenizer a while leaves the loop free: a ticker keeps ticking."""
    tokenizer = load_tokenizer(demo.model_dir)
    text = _words(1_000_000, seed=random.randrange(1 << 30))
    intake = PromptIntake(tokenizer, max_model_len=1 << 20, vocab_size=tokenizer.get_vocab_size(), threads=1,
                          max_queued_bytes_per_client=8 * MIB)

    async def run() -> tuple[float, float, list[int]]:
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                before = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - before - 0.005)

        tick = asyncio.create_task(ticker())
        started = time.perf_counter()
        ids = await intake.encode(b"c", text)
        took = time.perf_counter() - started
        done.set()
        await tick
        return took, max(lags), ids

    took, worst_lag, ids = asyncio.run(run())
    intake.close()
    assert ids == tokenizer.encode(text).ids
    assert took > 0.2, f"tokenizing took {took:.3f} s: too fast to show anything"
    assert worst_lag < took / 3, f"the loop stalled {worst_lag:.3f} s of a {took:.3f} s encode"


def test_a_clients_queued_bytes_are_bounded_and_others_are_not_held() -> None:
    tok = GatedTokenizer()
    intake = PromptIntake(tok, max_model_len=10_000, vocab_size=512, threads=2, max_queued_bytes_per_client=3000)

    async def run() -> None:
        first = asyncio.create_task(intake.encode(b"a", _words(2000, 1)))
        await asyncio.sleep(0.05)
        assert intake.queued_bytes(b"a") == 2000
        with pytest.raises(Rejected) as refused:  # over the budget while the first waits
            await intake.encode(b"a", _words(1500, 2))
        assert refused.value.code == "overloaded"
        other = asyncio.create_task(intake.encode(b"b", _words(2500, 3)))  # another client has its own
        await asyncio.sleep(0.05)
        first.cancel()  # the thread still holds the text: it still counts
        await asyncio.sleep(0.05)
        assert intake.queued_bytes(b"a") == 2000
        tok.gate.set()
        assert len(await other) == 2500
        for _ in range(100):
            if intake.queued_bytes(b"a") == 0:
                break
            await asyncio.sleep(0.01)
        assert intake.queued_bytes(b"a") == 0 and intake.queued_bytes(b"b") == 0
        assert len(await intake.encode(b"a", _words(2900, 4))) == 2900  # the budget is back

    asyncio.run(run())
    intake.close()


def test_clients_take_turns_at_the_tokenizer_and_a_cancelled_prompt_leaves_the_queue() -> None:
    """One client's queue of prompts does not hold another's behind all of it."""
    tok = GatedTokenizer()
    order: list[str] = []
    encode = tok.encode_batch

    def recording(texts: list[str]) -> list[SimpleNamespace]:
        order.append(texts[0][:2])
        return encode(texts)

    tok.encode_batch = recording
    intake = PromptIntake(tok, max_model_len=10_000, vocab_size=512, threads=1, max_queued_bytes_per_client=MIB)

    async def run() -> None:
        heavy = [asyncio.create_task(intake.encode(b"heavy", f"h{i}" + _words(500, i))) for i in range(5)]
        await asyncio.sleep(0.05)  # h0 is in the thread, h1..h4 wait
        light = asyncio.create_task(intake.encode(b"light", "l0" + _words(500, 9)))
        dropped = asyncio.create_task(intake.encode(b"gone", "g0" + _words(700, 10)))
        await asyncio.sleep(0.05)
        dropped.cancel()  # unstarted: its bytes are released at once
        await asyncio.sleep(0.01)
        assert intake.queued_bytes(b"gone") == 0 and intake.queued_bytes(b"heavy") == 5 * 502
        tok.gate.set()
        await asyncio.gather(light, *heavy)

    asyncio.run(run())
    intake.close()
    assert order == ["h0", "h1", "l0", "h2", "h3", "h4"]  # first come first served: l0 would be sixth


@pytest.mark.parametrize("prompt_len, max_tokens, expected", [
    (10, 90, 90), (10, None, 90), (99, None, 1), (10, 91, "context_length_exceeded"), (100, 1, "prompt_too_long"),
])
def test_max_tokens_is_checked_against_what_the_context_leaves(prompt_len, max_tokens, expected) -> None:
    intake = PromptIntake(None, max_model_len=100, vocab_size=512, threads=1, max_queued_bytes_per_client=MIB)
    ids = [random.randrange(512) for _ in range(prompt_len)]
    if isinstance(expected, int):
        assert intake.check_ids(ids, max_tokens) == expected
        return
    with pytest.raises(Rejected) as refused:
        intake.check_ids(ids, max_tokens)
    assert refused.value.code == expected
    if expected == "context_length_exceeded":
        assert "at most 90 new tokens fit" in refused.value.message


def test_token_ids_outside_the_vocabulary_are_named() -> None:
    intake = PromptIntake(None, max_model_len=100, vocab_size=512, threads=1, max_queued_bytes_per_client=MIB)
    with pytest.raises(Rejected) as refused:
        intake.check_ids([5, 600, 7], 4)
    assert refused.value.code == "invalid_token" and "600" in refused.value.message
    with pytest.raises(Rejected) as refused:
        PromptIntake(None, 100, 512, threads=1, max_queued_bytes_per_client=MIB).check_text("hello")
    assert refused.value.code == "invalid_field" and "prompt_token_ids" in refused.value.message


# ---- the serving core with a prompt held in the tokenizer ------------------------------------------

async def _core_with(tok: GatedTokenizer):
    sent: list = []

    async def send(identity, msg):
        sent.append((identity, msg))

    core = ServingCore(load_config(None, env={}), StubEngineLink(None, None, {}), send=send)
    await core.start([])
    core.admission.tokenizer = None  # the stub has no tokenizer.json: the gated one stands in
    core.admission.intake = PromptIntake(tok, core.hello.max_model_len, core.hello.vocab_size, threads=1,
                                         max_queued_bytes_per_client=MIB)
    return core, sent


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_requests_held_in_the_tokenizer_can_be_cancelled_dropped_or_time_out() -> None:
    async def run() -> None:
        tok = GatedTokenizer()
        core, sent = await _core_with(tok)
        await core.submit(b"a", GenerateRequest(request_id="c", prompt="to be cancelled", max_tokens=3))
        await core.submit(b"a", GenerateRequest(request_id="t", prompt="to time out", max_tokens=3,
                                                deadline_ms=50.0))
        await core.submit(b"b", GenerateRequest(request_id="g", prompt="its client goes", max_tokens=3))
        # A token-id prompt of another client is not held up by them.
        await core.submit(b"z", GenerateRequest(request_id="ids", prompt_token_ids=[5, 6], max_tokens=2))
        await _until(lambda: any(isinstance(m, DoneReply) and m.request_id == "ids" for _, m in sent))
        assert core.snapshot()["tokenizing"] == 3
        with pytest.raises(Rejected) as dup:
            await core.submit(b"a", GenerateRequest(request_id="c", prompt="again", max_tokens=3))
        assert dup.value.code == "duplicate_request"
        assert await core.cancel(b"a", "c")
        await core.client_gone(b"b")
        await _until(lambda: any(isinstance(m, ErrorReply) and m.request_id == "t" for _, m in sent))
        replies = {m.request_id: m for _, m in sent}
        assert isinstance(replies["c"], DoneReply) and replies["c"].finish_reason == "cancelled"
        assert replies["t"].code == "timeout"
        assert "g" not in replies
        assert not core.requests and not core.requests.tokenizing and core.requests.idle.is_set()
        tok.gate.set()  # the thread finishes: nothing is routed for requests that are gone
        await asyncio.sleep(0.1)
        stats = core.snapshot()
        assert stats["running"] == stats["waiting"] == stats["tokenizing"] == 0
        await core.submit(b"a", GenerateRequest(request_id="ok", prompt="now it goes", max_tokens=2))
        await _until(lambda: any(isinstance(m, DoneReply) and m.request_id == "ok" for _, m in sent))
        await core.stop()

    asyncio.run(run())


def test_a_tokenized_prompt_is_checked_before_it_is_routed() -> None:
    async def run() -> None:
        tok = GatedTokenizer()
        tok.gate.set()
        core, sent = await _core_with(tok)
        limit = core.hello.max_model_len
        await core.submit(b"a", GenerateRequest(request_id="long", prompt="w" * (limit - 4), max_tokens=10))
        await core.submit(b"a", GenerateRequest(request_id="fill", prompt="w" * (limit - 4), max_tokens=None,
                                                ignore_eos=True))
        await _until(lambda: len({m.request_id for _, m in sent if m.TYPE in ("error", "done")}) == 2, 30)
        replies = {m.request_id: m for _, m in sent if m.TYPE in ("error", "done")}
        assert replies["long"].code == "context_length_exceeded"
        assert "at most 4 new tokens fit" in replies["long"].message
        assert replies["fill"].finish_reason == "length" and len(replies["fill"].token_ids) == 4
        await core.stop()

    asyncio.run(run())
