"""One request can never fail the others, on a real daemon with the CPU demo model: while other
clients stream, a request with temperature 1e-45 is served greedily, one whose
repetition_penalty near 0 drives its logits to +inf fails alone with `sampling_error` (400
through the OpenAI gateway), and one whose row makes the forward raise (the engine's test-only
`token_raise` fault) fails alone with `engine_failed`. The others get exactly the tokens they
get undisturbed, and the engine is never restarted."""
from __future__ import annotations

import random
import threading
import time

import pytest

from loraplex.gateway.config import GatewayConfig
from loraplex.ipc.client import LoraplexError
from tests.daemon_process import DaemonProcess
from tests.test_gateway_e2e import GatewayThread

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def daemon(demo, tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    proc = DaemonProcess(root, env={"LORAPLEX_FAULTS": f"file={root / 'fault'}"})
    proc.fault_file = root / "fault"
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log()


class Streamer(threading.Thread):
    """One streaming request on its own connection."""

    def __init__(self, daemon, prompt: list[int], **options) -> None:
        super().__init__(daemon=True)
        self.daemon_proc, self.prompt, self.options = daemon, prompt, options
        self.token_ids: list[int] = []
        self.error: LoraplexError | None = None
        self.start()

    def run(self) -> None:
        try:
            with self.daemon_proc.client() as c:
                for chunk in c.stream(self.prompt, timeout=120, **self.options):
                    self.token_ids += chunk.token_ids
        except LoraplexError as exc:
            self.error = exc

    def finish(self) -> list[int]:
        self.join(120)
        assert not self.is_alive(), "request still running"
        assert self.error is None, self.error
        return self.token_ids


@pytest.fixture(scope="module")
def others(daemon):
    """The well-behaved clients (greedy with and without an adapter, and a seeded sampled one) and
    the tokens they get streaming together undisturbed."""
    rng = random.Random(random.SystemRandom().getrandbits(32))
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    options = [{"temperature": 0.0}, {"temperature": 0.0, "adapter": "qv-r8"},
               {"temperature": 0.8, "seed": rng.getrandbits(32), "adapter": "all-r32"}]
    requests = [(p, {**o, "max_tokens": MAX_TOKENS, "ignore_eos": True}) for p, o in zip(prompts, options)]
    streams = [Streamer(daemon, p, **o) for p, o in requests]
    return requests, [s.finish() for s in streams]


def _engine(daemon) -> tuple[int, int]:
    with daemon.client() as c:
        stats = c.stats()
    return stats["engine"]["pid"], stats["engine_restarts"]


def _while_others_stream(daemon, others, abuse) -> list[list[int]]:
    """Start the others, run `abuse()` once each has streamed a few tokens, return their tokens."""
    streams = [Streamer(daemon, p, **o) for p, o in others[0]]
    deadline = time.monotonic() + 60
    while not all(len(s.token_ids) >= 3 for s in streams):
        assert time.monotonic() < deadline, "the others did not start streaming"
        time.sleep(0.01)
    abuse()
    assert all(len(s.token_ids) < MAX_TOKENS for s in streams), "the others finished before the abuse"
    return [s.finish() for s in streams]


def test_bad_sampling_numbers_fail_only_their_own_request(daemon, others):
    rng = random.Random(random.SystemRandom().getrandbits(32))
    tiny_prompt, inf_prompt = ([rng.randrange(3, 500) for _ in range(6)] for _ in range(2))
    with daemon.client() as c:
        greedy = c.generate(tiny_prompt, temperature=0.0, max_tokens=4, ignore_eos=True).token_ids
    before = _engine(daemon)
    got: dict[str, object] = {}

    def abuse() -> None:
        def tiny() -> None:
            with daemon.client() as c:
                got["tiny"] = c.generate(tiny_prompt, temperature=1e-45, max_tokens=4, ignore_eos=True,
                                         timeout=60).token_ids

        def inf() -> None:  # a seen token's logit of +100 divided by 1e-45: +inf, then NaN probabilities
            try:
                with daemon.client() as c:
                    c.generate(inf_prompt, temperature=1.0, repetition_penalty=1e-45, logit_bias={inf_prompt[0]: 100.0},
                               max_tokens=4, timeout=60)
            except LoraplexError as exc:
                got["inf"] = exc

        threads = [threading.Thread(target=f) for f in (tiny, inf)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    assert _while_others_stream(daemon, others, abuse) == others[1]
    assert got["tiny"] == greedy, "a temperature below the floor is greedy"
    assert isinstance(got.get("inf"), LoraplexError) and got["inf"].code.value == "sampling_error", got
    assert "NaN or +inf" in got["inf"].message
    assert _engine(daemon) == before, "the engine was restarted"


def test_sampling_error_is_a_400_through_the_gateway(daemon):
    openai = pytest.importorskip("openai")
    gateway = GatewayThread(GatewayConfig(port=0, runtime_dir=daemon.runtime_dir, stats_cache_s=0.0)).start()
    try:
        with gateway.client() as client:
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model="loraplex-base", prompt=[9, 10, 11], max_tokens=4, temperature=1.0,
                                          logit_bias={"9": 100}, extra_body={"repetition_penalty": 1e-45})
            assert info.value.status_code == 400 and info.value.code == "sampling_error", info.value
            greedy, tiny = (client.completions.create(model="loraplex-base", prompt=[9, 10, 11], max_tokens=4,
                                                      temperature=t, extra_body={"ignore_eos": True})
                            for t in (0.0, 1e-45))
            assert tiny.choices[0].text == greedy.choices[0].text
    finally:
        gateway.close()


def test_a_row_that_makes_the_forward_raise_fails_alone(daemon, others):
    """Last in this module: the fault stays armed for the engine's lifetime."""
    rng = random.Random(random.SystemRandom().getrandbits(32))
    used = {t for p, _ in others[0] for t in p} | {t for out in others[1] for t in out}
    poison = rng.choice([t for t in range(3, 500) if t not in used])
    before = _engine(daemon)
    tmp = daemon.fault_file.with_suffix(".tmp")
    tmp.write_text(f"token_raise={poison}")
    tmp.rename(daemon.fault_file)
    failed: list[LoraplexError] = []

    def abuse() -> None:
        try:
            with daemon.client() as c:
                c.generate([5, poison, 7], max_tokens=4, timeout=60)
        except LoraplexError as exc:
            failed.append(exc)

    assert _while_others_stream(daemon, others, abuse) == others[1]
    assert not daemon.fault_file.exists(), "the fault was never armed"
    assert failed and failed[0].code.value == "engine_failed", failed
    assert "the rest of its step ran without it" in failed[0].message
    assert _engine(daemon) == before, "the engine was restarted"
    assert f"feeds token {poison}" in daemon.log()
