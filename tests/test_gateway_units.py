"""The gateway's pure parts without a daemon: request parsing, error mapping,
chat templates (sandboxed), response shapes and the metrics derived from a
hand-built stats snapshot."""
from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.gateway.chat_template import DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError
from loraplex.gateway.config import GatewayConfig
from loraplex.gateway.daemon_metrics import DaemonStats
from loraplex.gateway.errors import ApiError, from_daemon
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.gateway.openai_format import Tokens
from loraplex.gateway.schema import COMPLETIONS_DEFAULT_MAX_TOKENS, parse_chat, parse_completion
from loraplex.ipc.client import GenerateResult
from loraplex.ipc.errors import ErrorCode, LoraplexError
from loraplex.ipc.guided import Guided


# ---- requests -----------------------------------------------------------------------------------
def test_completion_request_defaults_and_prompt_shapes():
    req = parse_completion({"model": "qv-r8", "prompt": "hi"})
    assert req.model == "qv-r8" and req.prompts == ["hi"] and not req.stream
    assert req.sampling.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS and req.sampling.temperature == 1.0
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", [4, 5]]}).prompts == ["a", [4, 5]]
    s = parse_completion({"prompt": "x", "stop": "\n", "seed": 7, "top_k": 0, "temperature": 0,
                          "max_tokens": 5, "logprobs": 0}).sampling
    assert (s.stop, s.seed, s.top_k, s.temperature, s.max_tokens, s.logprobs) == (("\n",), 7, -1, 0.0, 5, True)
    assert parse_completion({"prompt": "x", "stop": ["a", "b"]}).sampling.stop == ("a", "b")
    req = parse_completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.include_usage
    req = parse_completion({"prompt": "x", "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -1,
                            "repetition_penalty": 1.1, "logit_bias": {"5": -100}, "min_tokens": 2, "echo": False})
    s = req.sampling
    assert (s.logprobs, s.top_logprobs, s.presence_penalty, s.frequency_penalty, s.repetition_penalty,
            s.min_tokens) == (True, 3, 0.5, -1.0, 1.1, 2)
    assert s.client_kwargs()["logit_bias"] == {"5": -100} and not req.echo
    assert parse_completion({"prompt": "x", "echo": True}).echo
    assert parse_completion({"prompt": "x", "n": 3}).sampling.client_kwargs()["n"] == 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": ["a", "b"], "n": 100}, "n"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "stream"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "model": 3}, "model"),
])
def test_completion_request_errors_name_the_parameter(body, param):
    with pytest.raises(ApiError) as info:
        parse_completion(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_request_flattens_text_parts_and_refuses_the_rest():
    req = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ], "max_completion_tokens": 9, "logprobs": True})
    assert [m["content"] for m in req.messages] == ["be brief", "a\nb", ""]
    assert req.sampling.max_tokens == 9 and req.sampling.logprobs and req.add_generation_prompt
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                       "top_logprobs": 4}).sampling.top_logprobs == 4
    user = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert parse_chat({"messages": user, "response_format": fmt}).sampling.guided == Guided.json(schema)
    assert parse_chat({"messages": user, "response_format": {"type": "json_object"}}).sampling.guided == \
        Guided.json_object()
    assert parse_chat({"messages": user, "response_format": {"type": "text"}}).sampling.guided is None
    assert parse_completion({"prompt": "x", "guided_choice": ["a", "b"]}).sampling.guided == Guided.choice(["a", "b"])
    assert parse_completion({"prompt": "x", "guided_regex": "[0-9]+"}).sampling.client_kwargs()["guided"] == \
        Guided.regex("[0-9]+")
    # Without max_tokens a chat fills what the context leaves (vLLM), which only the daemon knows.
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
                {"messages": [{"role": "user", "content": "x"}], "echo": True},
                {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
                {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
                {"messages": [{"role": "user", "content": "x"}], "guided_choice": []},
                {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a", "guided_choice": ["a"]},
                {"messages": [{"role": "user", "content": "x"}], "guided_json": "[1"}):
        with pytest.raises(ApiError):
            parse_chat(bad)


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, status, openai_code", [
    (ErrorCode.UNKNOWN_ADAPTER, 404, "model_not_found"),
    (ErrorCode.PROMPT_TOO_LONG, 400, "context_length_exceeded"),
    (ErrorCode.CONTEXT_LENGTH_EXCEEDED, 400, "context_length_exceeded"),
    (ErrorCode.INVALID_TOKEN, 400, "invalid_token"),
    (ErrorCode.OVERLOADED, 429, "overloaded"),
    (ErrorCode.UNAVAILABLE, 503, "unavailable"),
    (ErrorCode.ENGINE_FAILED, 503, "engine_failed"),
    (ErrorCode.SHUTTING_DOWN, 503, "shutting_down"),
    (ErrorCode.TIMEOUT, 504, "timeout"),
    (ErrorCode.NOT_FOUND, 404, "not_found"),
    (ErrorCode.INTERNAL, 500, "internal"),
])
def test_daemon_errors_map_to_http(code, status, openai_code):
    error = from_daemon(LoraplexError(code, "boom"), model="m")
    body = error.body()["error"]
    assert error.status == status and body["code"] == openai_code
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == ("server_error" if status >= 500 else "rate_limit_error" if status == 429
                            else "invalid_request_error")
    if code is ErrorCode.CONTEXT_LENGTH_EXCEEDED:
        assert body["param"] == "max_tokens"


# ---- chat templates -----------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def test_builtin_template_is_role_lines_then_the_assistant_cue(tmp_path):
    assert ChatTemplate(DEFAULT_TEMPLATE).render(MESSAGES) == "system: S\nuser: U\nassistant:"
    assert ChatTemplate.from_model_dir(None).render(MESSAGES, add_generation_prompt=False) == "system: S\nuser: U\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES).endswith("assistant:")


def test_model_templates_from_tokenizer_config_and_jinja_file(tmp_path):
    source = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
         "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": source}]}))
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES) == "<s>[system]S</s>[user]U</s>[assistant]"
    other = tmp_path / "other"
    other.mkdir()
    (other / "chat_template.jinja").write_text("{{ messages | length }}{{ messages[0] | tojson }}")
    assert ChatTemplate.from_model_dir(other).render(MESSAGES) == '2{"role": "system", "content": "S"}'


@pytest.mark.parametrize("source", [
    "{{ messages.append(1) }}",                         # mutation: the sandbox is immutable
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",   # attribute escape
    "{{ raise_exception('roles must alternate') }}",
])
def test_templates_run_sandboxed_and_failures_are_chat_template_errors(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(MESSAGES)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for %}")


# ---- response shapes ----------------------------------------------------------------------------
def test_tokens_keep_text_pieces_aligned_with_logprobs():
    tokens = Tokens()
    tokens.extend("ab", 1, [-0.5])
    tokens.extend("", 1, [-1.0])   # text held back by the detokenizer
    tokens.extend("c", 2, [-2.0, -3.0])
    tokens.extend("d", 0, None)    # the flushed tail joins the last token
    assert tokens.texts == ["ab", "", "c", "d"] and "".join(tokens.texts) == "abcd"
    assert tokens.logprobs == [-0.5, -1.0, -2.0, -3.0]
    tokens.extend("e", 1, None)  # no logprob from the daemon: JSON null, never a made-up number
    assert tokens.logprobs[-1] is None and len(tokens.logprobs) == len(tokens.texts)


# ---- metrics ------------------------------------------------------------------------------------
SNAPSHOT = {
    "uptime_s": 12.0, "requests": 10, "errors": 1, "tokens": 300, "steps": 40, "engine_restarts": 0,
    "preemptions": 2, "adapter_placements": 3, "adapter_evictions": 1,
    "finish_reasons": {"length": 8, "stop": 1}, "adapter_paths": {"base": 2, "cached": 5, "loaded": 2,
                                                                  "cpu_assisted": 1},
    "requests_by_adapter": {"<base>": 2, "qv-r8": 8},
    "latency": {"ttft_ms": {"p50": 20.0, "p99": 80.0, "n": 9}, "tpt_ms": {"p50": 5.0, "p99": 9.0, "n": 9}},
    "pcie": {"h2d_mb_s": 2.0, "d2h_mb_s": 0.5, "link_mb_s": 100.0, "utilisation_pct": 2.0,
             "total_bytes": {"adapter_h2d": 4096, "assist_d2h": 1024, "assist_h2d": 2048}},
    "running": 3, "waiting": 4, "pool": {"total": 100, "free": 40, "kv": 50, "adapter": 10},
    "resident_adapters": ["qv-r8", "all-r32"],
    "cpu_assist": {"jobs": 6, "failures": 0, "cpu_rows": 6, "busy_ms": 1000.0,
                   "workers": [{"index": 0, "alive": True, "pending": 1, "starts": 2},
                               {"index": 1, "alive": False, "pending": 0, "starts": 1, "busy_pct": 50.0}]},
}


class FakeDaemon:
    def __init__(self, snapshots):
        self.snapshots = list(snapshots)
        self.polls = 0

    async def poll(self, timeout: float) -> dict:
        self.polls += 1
        item = self.snapshots.pop(0) if len(self.snapshots) > 1 else self.snapshots[0]
        if isinstance(item, Exception):
            raise item
        return item


def _scrape(metrics: GatewayMetrics) -> dict[str, list]:
    """Samples by sample name (counters end in _total, histograms in _count/_sum/_bucket)."""
    text = asyncio.run(metrics.exposition()).decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples, name, **labels) -> float:
    matches = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_daemon_families_from_a_snapshot():
    metrics = GatewayMetrics(DaemonStats(FakeDaemon([SNAPSHOT]).poll, timeout_s=1, cache_s=0), max_loras=8)
    f = _scrape(metrics)
    assert _value(f, "loraplex_daemon_up") == 1.0
    assert _value(f, "loraplex_num_requests_running") == 3 and _value(f, "vllm:num_requests_waiting") == 4
    assert _value(f, "loraplex_daemon_requests_total") == 10
    assert _value(f, "loraplex_daemon_requests_finished_total", finish_reason="length") == 8
    assert _value(f, "loraplex_daemon_latency_seconds", metric="ttft", quantile="0.99") == pytest.approx(0.08)
    assert _value(f, "loraplex_pool_pages", kind="kv") == 50 and _value(f, "vllm:gpu_cache_usage_perc") == 0.5
    assert _value(f, "vllm:kv_cache_usage_perc") == 0.5
    assert _value(f, "loraplex_adapter_cache_hit_ratio", tier="gpu") == pytest.approx(5 / 8)
    assert _value(f, "loraplex_adapter_path_requests_total", path="cpu_assisted") == 1
    assert _value(f, "loraplex_pcie_transferred_bytes_total", purpose="assist_d2h", direction="d2h") == 1024
    assert _value(f, "loraplex_pcie_throughput_bytes_per_second", direction="h2d") == 2e6
    assert _value(f, "loraplex_pcie_link_utilisation_ratio") == pytest.approx(0.02)
    assert _value(f, "loraplex_cpu_assist_busy_seconds_total") == 1.0
    assert _value(f, "loraplex_cpu_worker_up", worker="1") == 0.0
    assert _value(f, "loraplex_cpu_worker_restarts_total", worker="0") == 1.0
    assert _value(f, "loraplex_cpu_worker_busy_ratio", worker="1") == 0.5
    info = f["vllm:lora_requests_info"][0]
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "8"}


def test_cache_map_tiers_win_over_adapter_paths():
    snapshot = {**SNAPSHOT, "cache": {"hit_rate": 0.9, "hits": 9, "misses": 1, "evictions": 4,
                                      "host": {"hits": 3, "misses": 1}}, "max_loras_per_batch": 4}
    f = _scrape(GatewayMetrics(DaemonStats(FakeDaemon([snapshot]).poll, timeout_s=1, cache_s=0), max_loras=8))
    assert _value(f, "loraplex_adapter_cache_hit_ratio", tier="gpu") == pytest.approx(0.9)
    assert _value(f, "loraplex_adapter_cache_hit_ratio", tier="host") == pytest.approx(0.75)
    assert _value(f, "loraplex_adapter_cache_evictions_total") == 4
    assert f["vllm:lora_requests_info"][0].labels["max_lora"] == "4"


def test_stats_are_cached_and_an_absent_daemon_is_reported_down():
    now = [100.0]
    daemon = FakeDaemon([LoraplexError(ErrorCode.UNAVAILABLE, "down"), SNAPSHOT])
    stats = DaemonStats(daemon.poll, timeout_s=1, cache_s=0.5, clock=lambda: now[0])
    metrics = GatewayMetrics(stats, max_loras=8)
    f = _scrape(metrics)
    assert _value(f, "loraplex_daemon_up") == 0.0 and "loraplex_num_requests_running" not in f
    _scrape(metrics)
    assert daemon.polls == 1  # within the cache window
    now[0] += 0.6
    assert _value(_scrape(metrics), "loraplex_daemon_up") == 1.0 and daemon.polls == 2


def test_worker_utilisation_from_busy_time_between_polls():
    now = [0.0]
    first = SNAPSHOT
    second = {**SNAPSHOT, "cpu_assist": {**SNAPSHOT["cpu_assist"], "busy_ms": 2000.0}}
    stats = DaemonStats(FakeDaemon([first, second]).poll, timeout_s=1, cache_s=0.5, clock=lambda: now[0])
    metrics = GatewayMetrics(stats, max_loras=8)
    assert "loraplex_cpu_workers_utilisation_ratio" not in _scrape(metrics)
    now[0] = 1.0  # 1000 busy ms over 1 s on 2 workers
    assert _value(_scrape(metrics), "loraplex_cpu_workers_utilisation_ratio") == pytest.approx(0.5)


def test_gateway_histograms_and_lora_requests_info_follow_requests():
    metrics = GatewayMetrics(DaemonStats(FakeDaemon([SNAPSHOT]).poll, timeout_s=1, cache_s=0), max_loras=8)
    waiting = metrics.in_flight.start("qv-r8", "qv-r8")
    running = metrics.in_flight.start("all-r32", "all-r32")
    running.running()
    base = metrics.in_flight.start("loraplex-base", None)
    base.running()
    f = _scrape(metrics)
    info = f["vllm:lora_requests_info"][0]
    assert info.labels["running_lora_adapters"] == "all-r32" and info.labels["waiting_lora_adapters"] == "qv-r8"
    assert info.value > 1.6e9  # the scrape's unix time, as vLLM
    assert _value(f, "loraplex_gateway_requests_in_flight", model="qv-r8", state="waiting") == 1
    for ticket in (waiting, running, base):
        ticket.done()
        ticket.done()  # idempotent
    result = GenerateResult(request_id="r", text="x", token_ids=[1, 2, 3], finish_reason="length",
                            usage={"prompt_tokens": 4, "completion_tokens": 3},
                            timings={"queue_ms": 1.0, "ttft_ms": 30.0, "tpt_ms": 10.0, "e2e_ms": 50.0,
                                     "adapter_path": "cached"})
    metrics.finished("qv-r8", result)
    metrics.request("completions", "qv-r8", "success")
    f = _scrape(metrics)
    assert f["vllm:lora_requests_info"][0].labels["running_lora_adapters"] == ""
    assert "loraplex_gateway_requests_in_flight" not in f
    assert _value(f, "loraplex_gateway_time_to_first_token_seconds_count", model="qv-r8") == 1
    assert _value(f, "loraplex_gateway_time_to_first_token_seconds_sum", model="qv-r8") == pytest.approx(0.03)
    assert _value(f, "loraplex_gateway_time_per_output_token_seconds_sum", model="qv-r8") == pytest.approx(0.01)
    assert _value(f, "loraplex_gateway_e2e_request_latency_seconds_count", model="qv-r8") == 1
    assert _value(f, "loraplex_gateway_requests_total", model="qv-r8", endpoint="completions",
                  outcome="success") == 1
    assert _value(f, "loraplex_gateway_generation_tokens_total", model="qv-r8") == 3


def test_registry_is_private():
    from prometheus_client import REGISTRY

    metrics = GatewayMetrics(DaemonStats(FakeDaemon([SNAPSHOT]).poll, timeout_s=1, cache_s=0), max_loras=8)
    metrics.request("chat", "m", "success")
    assert b"loraplex_gateway_requests_total" not in generate_latest(REGISTRY)


def test_config_validation():
    with pytest.raises(ValueError):
        GatewayConfig(port=70000)
    with pytest.raises(ValueError):
        GatewayConfig(served_model_name=" ")
    with pytest.raises(ValueError):
        GatewayConfig(request_timeout_s=0)
    with pytest.raises(ValueError):
        GatewayConfig(model_dir="/nonexistent/model")
