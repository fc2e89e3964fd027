"""The OpenAI-compatible gateway end to end: a real daemon on the demo model,
gateways serving in a background thread, and the official `openai` package
as the client (completions, chat, streaming, models, errors, adapter
load/unload, client disconnects) plus /metrics read with prometheus-client's
parser. The `loraplex gateway` command is checked as a subprocess."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from loraplex.gateway.app import serve
from loraplex.gateway.config import GatewayConfig
from tests.daemon_process import DaemonProcess

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DEMO_ADAPTERS = {"all-r32", "attn-r16", "kdown-r8", "mlp-r64", "qv-r8", "rslora-r16"}
BASE = "loraplex-base"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


class GatewayThread:
    """`serve()` on a free localhost port in a thread with its own event loop."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayThread:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the gateway did not start: {self._error!r}")
        return self

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()

        def listening(host: str, port: int) -> None:
            self.port = port
            self._ready.set()

        await serve(self.config, stop=self._stop, on_listening=listening)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the gateway did not stop"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def daemon(demo, tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("gwd")).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def gateway(daemon):
    gw = GatewayThread(GatewayConfig(port=0, runtime_dir=daemon.runtime_dir, stats_cache_s=0.0)).start()
    yield gw
    gw.close()


@pytest.fixture(scope="module")
def admin_gateway(daemon):
    gw = GatewayThread(GatewayConfig(port=0, runtime_dir=daemon.runtime_dir, enable_adapter_admin=True,
                                     served_model_name="demo-base")).start()
    yield gw
    gw.close()


@pytest.fixture
def client(gateway):
    with gateway.client() as c:
        yield c


def _post(url: str, body: object) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def test_models_list_the_base_and_every_adapter(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE} | DEMO_ADAPTERS
    assert models[BASE].owned_by == "loraplex"
    for name in DEMO_ADAPTERS:
        assert models[name].model_extra["parent"] == BASE
        assert models[name].model_extra["root"].endswith(name)
    assert client.models.retrieve("qv-r8").id == "qv-r8"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")


def test_completions_pick_the_adapter_by_model(client):
    base = client.completions.create(model=BASE, prompt="Once upon a time", **GREEDY)
    tuned = client.completions.create(model="qv-r8", prompt="Once upon a time", **GREEDY)
    again = client.completions.create(model="qv-r8", prompt="Once upon a time", **GREEDY)
    assert base.object == "text_completion" and tuned.model == "qv-r8"
    assert tuned.choices[0].text == again.choices[0].text  # greedy is deterministic
    assert tuned.choices[0].text != base.choices[0].text   # the adapter changes the output
    assert tuned.choices[0].finish_reason == "length"
    assert tuned.usage.completion_tokens == 12 and tuned.usage.prompt_tokens > 0
    assert tuned.usage.total_tokens == tuned.usage.prompt_tokens + 12
    short = client.completions.create(model=BASE, prompt=[5, 6, 7], max_tokens=3, temperature=0.0)
    assert short.usage.prompt_tokens == 3 and short.usage.completion_tokens <= 3


def test_stop_strings_seed_and_logprobs(client):
    text = client.completions.create(model="all-r32", prompt="The river", **GREEDY).choices[0].text
    stop = text[3:5]
    assert stop and stop in text
    stopped = client.completions.create(model="all-r32", prompt="The river", stop=[stop, "\x00"], **GREEDY)
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[:text.index(stop)]
    sampled = [client.completions.create(model=BASE, prompt="The river", max_tokens=8, temperature=1.0,
                                         seed=1234).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    scored = client.completions.create(model="mlp-r64", prompt="The river", logprobs=0, **GREEDY).choices[0]
    assert len(scored.logprobs.token_logprobs) == 12 and all(lp <= 0 for lp in scored.logprobs.token_logprobs)
    assert "".join(scored.logprobs.tokens) == scored.text
    chat = client.chat.completions.create(model="qv-r8", messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, **GREEDY).choices[0]
    assert len(chat.logprobs.content) == 12 and "".join(t.token for t in chat.logprobs.content) == \
        chat.message.content


def test_tokens_as_token_ids_name_the_daemons_own_tokens(client, daemon):
    """vLLM's return_tokens_as_token_ids: every token and alternative in logprobs is "token_id:N",
    N the id the daemon sampled (its raw reply), in whole, streamed and chat answers; the text
    is unchanged and chat's bytes stay the token's text."""
    with daemon.client() as raw:
        expected = raw.generate("The river", adapter="mlp-r64", max_tokens=12, temperature=0.0,
                                ignore_eos=True).token_ids
    as_ids = {"temperature": 0.0, "max_tokens": 12,
              "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}

    def ids(labels: list[str]) -> list[int]:
        assert all(re.fullmatch(r"token_id:\d+", label) for label in labels), labels
        return [int(label.split(":")[1]) for label in labels]

    whole = client.completions.create(model="mlp-r64", prompt="The river", logprobs=2, **as_ids).choices[0]
    assert ids(whole.logprobs.tokens) == expected
    plain = client.completions.create(model="mlp-r64", prompt="The river", **GREEDY).choices[0]
    assert whole.text == plain.text
    for token, top in zip(whole.logprobs.tokens, whole.logprobs.top_logprobs, strict=True):
        ids(list(top))
        assert max(top, key=top.get) == token  # greedy: the sampled token is the most likely
    streamed = [label for chunk in client.completions.create(model="mlp-r64", prompt="The river", logprobs=0,
                                                             stream=True, **as_ids)
                for c in chunk.choices if c.logprobs for label in c.logprobs.tokens]
    assert ids(streamed) == expected
    chat = client.chat.completions.create(model="qv-r8", messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=2, **as_ids).choices[0]
    assert len(ids([t.token for t in chat.logprobs.content])) == 12
    assert all(ids([alt.token for alt in t.top_logprobs]) for t in chat.logprobs.content)
    assert bytes(b for t in chat.logprobs.content for b in t.bytes).decode("utf-8", "replace") == \
        chat.message.content


def test_chat_uses_the_builtin_template(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="rslora-r16", messages=messages, **GREEDY)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    # The demo tokenizer has no chat template: "role: content" lines and "assistant:".
    prompt = "system: You are terse.\nuser: Hello\nassistant:"
    plain = client.completions.create(model="rslora-r16", prompt=prompt, **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_deltas_concatenate_to_the_plain_answer(client):
    for model in (BASE, "attn-r16"):
        plain = client.completions.create(model=model, prompt="In the morning", **GREEDY).choices[0].text
        chunks = list(client.completions.create(model=model, prompt="In the morning", stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
        messages = [{"role": "user", "content": "In the morning"}]
        chat = client.chat.completions.create(model=model, messages=messages, **GREEDY)
        deltas = list(client.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY))
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
        assert deltas[-1].choices[0].finish_reason == "length"


def test_batched_prompts_and_concurrent_requests_share_one_daemon_client(gateway, client):
    prompts = ["a quiet house", "the letter", "a river"]
    batch = client.completions.create(model="kdown-r8", prompt=prompts, **GREEDY)
    single = [client.completions.create(model="kdown-r8", prompt=p, **GREEDY).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == single
    assert batch.usage.completion_tokens == 36
    streamed = ["", "", ""]
    for chunk in client.completions.create(model="kdown-r8", prompt=prompts, stream=True, **GREEDY):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == single

    async def many() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as aclient:
            calls = [aclient.completions.create(model=m, prompt="a river", **GREEDY)
                     for m in sorted(DEMO_ADAPTERS) * 3]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]

    expected = {m: client.completions.create(model=m, prompt="a river", **GREEDY).choices[0].text
                for m in DEMO_ADAPTERS}
    assert asyncio.run(many()) == [expected[m] for m in sorted(DEMO_ADAPTERS) * 3]


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not/a valid name", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="hello " * 5000, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    for stream in (False, True):  # prompt + max_tokens past the context: vLLM's 400, before any token
        with pytest.raises(openai.BadRequestError) as info:
            list(client.completions.create(model="qv-r8", prompt=[5, 6, 7], max_tokens=4094, stream=True)) \
                if stream else client.completions.create(model="qv-r8", prompt=[5, 6, 7], max_tokens=4094)
        assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
        assert "at most 4093 new tokens fit" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="x", n=500)
    assert info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt=[1, 2, 100_000], max_tokens=2)
    assert info.value.code == "invalid_token"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="x", temperature=500.0)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):  # an over-long prompt fails before the stream starts
        list(client.chat.completions.create(model="qv-r8", stream=True,
                                            messages=[{"role": "user", "content": "hello " * 5000}]))
    status, body = _post(f"{client.base_url}completions", ["not", "an", "object"])
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_without_a_daemon_requests_get_503_and_metrics_say_down(tmp_path):
    runtime_dir = tmp_path / "rt"
    runtime_dir.mkdir(mode=0o700)
    gw = GatewayThread(GatewayConfig(port=0, runtime_dir=runtime_dir)).start()
    try:
        with gw.client() as client:
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(model=BASE, prompt="x", max_tokens=2)
            assert info.value.status_code == 503 and info.value.code == "unavailable"
            with pytest.raises(openai.InternalServerError):
                client.models.list()
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(f"{gw.url}/health", timeout=30)
        http.value.close()
        assert http.value.code == 503
        with urllib.request.urlopen(f"{gw.url}/metrics", timeout=30) as response:
            s = _samples(response.read().decode())
        assert s["loraplex_daemon_up"][0].value == 0.0 and "loraplex_num_requests_running" not in s
        assert s["loraplex_gateway_requests_total"][0].labels["outcome"] == "unavailable"
    finally:
        gw.close()


def test_admin_endpoints_are_404_unless_enabled(gateway, daemon):
    for path, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                       ("unload_lora_adapter", {"lora_name": "qv-r8"})):
        status, text = _post(f"{gateway.url}/v1/{path}", body)
        assert status == 404 and json.loads(text)["error"]["code"] == "not_found"
    with daemon.client() as c:
        assert "qv-r8" in {a.name for a in c.adapters()}


def test_load_and_unload_adapters_when_enabled(admin_gateway, demo):
    url, qv_path = f"{admin_gateway.url}/v1", str(demo.adapters["qv-r8"])
    with admin_gateway.client() as client:
        status, text = _post(f"{url}/load_lora_adapter", {"lora_name": "qv-copy", "lora_path": qv_path})
        assert status == 200 and "qv-copy" in text, text
        models = {m.id: m for m in client.models.list().data}
        assert models["qv-copy"].model_extra["parent"] == "demo-base" and "demo-base" in models
        copy = client.completions.create(model="qv-copy", prompt="Once upon a time", **GREEDY).choices[0].text
        original = client.completions.create(model="qv-r8", prompt="Once upon a time", **GREEDY).choices[0].text
        assert copy == original  # same weights under another name
        status, text = _post(f"{url}/load_lora_adapter", {"lora_name": "qv-copy", "lora_path": qv_path})
        assert status == 400 and json.loads(text)["error"]["code"] == "already_exists"
        status, text = _post(f"{url}/load_lora_adapter", {"lora_name": "broken", "lora_path": str(demo.model_dir)})
        assert status == 400, text
        status, text = _post(f"{url}/unload_lora_adapter", {"lora_name": "qv-copy"})
        assert status == 200 and "qv-copy" in text
        assert "qv-copy" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="qv-copy", prompt="x", max_tokens=2)
        status, text = _post(f"{url}/unload_lora_adapter", {"lora_name": "qv-copy"})
        assert status == 404 and json.loads(text)["error"]["code"] == "not_found"
        status, _ = _post(f"{url}/load_lora_adapter", {"lora_name": "x"})
        assert status == 400


def test_a_client_that_disconnects_cancels_its_generation(gateway, daemon):
    with daemon.client() as c:
        before = c.stats()["cancelled"]
    with gateway.client() as client:
        stream = client.completions.create(model="mlp-r64", prompt="a", max_tokens=4000, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
    deadline = time.monotonic() + 20
    while True:
        with daemon.client() as c:
            stats = c.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["cancelled"] > before:
            break
        assert time.monotonic() < deadline, f"the generation kept running: {stats}"
        time.sleep(0.1)


def _samples(text: str) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def test_metrics_after_requests(gateway, client):
    for model in ("qv-r8", "qv-r8", BASE):
        client.completions.create(model=model, prompt="metrics", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)
    with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        s = _samples(response.read().decode())

    def value(name: str, **labels: str) -> float:
        found = [x.value for x in s[name] if all(x.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, s.get(name))
        return found[0]

    assert value("loraplex_gateway_requests_total", model="qv-r8", endpoint="completions", outcome="success") >= 2
    assert value("loraplex_gateway_requests_total", model="", endpoint="completions", outcome="model_not_found") >= 1
    assert value("loraplex_gateway_request_success_total", model="qv-r8", finished_reason="length") >= 2
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert value(f"loraplex_gateway_{hist}_seconds_count", model="qv-r8") >= 2
        assert value(f"loraplex_gateway_{hist}_seconds_sum", model="qv-r8") > 0
        assert value(f"loraplex_gateway_{hist}_seconds_bucket", model="qv-r8", le="+Inf") >= 2
    assert value("loraplex_gateway_generation_tokens_total", model=BASE) >= 12
    assert value("loraplex_daemon_up") == 1.0
    assert value("loraplex_num_requests_running") >= 0 and value("vllm:num_requests_waiting") >= 0
    assert value("loraplex_daemon_requests_total") >= 3
    assert value("loraplex_adapter_path_requests_total", path="base") >= 1
    assert 0.0 <= value("loraplex_adapter_cache_hit_ratio", tier="gpu") <= 1.0
    assert value("loraplex_pcie_transferred_bytes_total", purpose="adapter_h2d", direction="h2d") > 0
    assert value("loraplex_pool_pages", kind="total") == 600
    info = s["vllm:lora_requests_info"]
    assert len(info) == 1 and set(info[0].labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert info[0].labels["max_lora"] == "64" and abs(info[0].value - time.time()) < 60
    with urllib.request.urlopen(f"{gateway.url}/health", timeout=30) as response:
        assert response.status == 200


def test_the_gateway_command(daemon, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "gateway", "--port", "0", "--runtime-dir", str(daemon.runtime_dir),
         "--served-model-name", "cli-base"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    try:
        port = None
        for line in proc.stderr:
            if found := re.search(r"http://127\.0\.0\.1:(\d+)/v1", line):
                port = int(found[1])
                break
        assert port is not None, "the gateway never said where it listens"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
            ids = {m["id"] for m in json.load(response)["data"]}
        assert ids == {"cli-base"} | DEMO_ADAPTERS
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        proc.stderr.close()
    check = subprocess.run([sys.executable, "-c", "import sys, loraplex.gateway.app, loraplex.gateway.cli; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "False"
    bad = subprocess.run([sys.executable, "-m", "loraplex.cli", "gateway", "--model-dir", str(Path(tmp_path) / "x")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "model_dir" in bad.stderr
