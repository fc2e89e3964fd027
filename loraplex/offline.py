"""The offline API: `LLM(model).generate(prompts, adapters=..., sampling=...)`, with
`SamplingParams` (vLLM-style names) and `RequestOutput`.

Sits above both sides: it wires the daemon's torch-free policy (FCFS scheduler, page
allocator, adapter residency) to the engine's in-process executor, as the daemon drives
an engine process. Every request is validated before any is queued, so a bad input
raises a specific error and leaves the engine as it was. Import it as
`from loraplex import LLM, SamplingParams` (which loads torch only then).
"""
from __future__ import annotations

import itertools
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
from typing import Sequence as Seq

import torch

from loraplex.contracts.engine_spec import DEFAULT_MAX_NUM_SEQS, EngineSpec
from loraplex.contracts.names import NAME_RULE, is_valid_name
from loraplex.daemon.memory.allocator import PageAllocator
from loraplex.daemon.prompt_logprobs import PromptLogprobBook
from loraplex.daemon.scheduler.fcfs import FcfsScheduler, SchedulerConfig
from loraplex.daemon.scheduler.sequence import SeqRequest, Sequence
from loraplex.errors import AdapterError, InvalidTokenError, PromptTooLongError, UnknownAdapterError
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter
from loraplex.gpu_engine.pool import kv_window
from loraplex.gpu_engine.runtime import build_runtime
from loraplex.ipc.engine_plan import SamplingSpec
from loraplex.ipc.guided import Guided

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling; validated on construction (ValueError naming the field)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    guided: Guided | None = None  # structured output: Guided.json(schema), .regex(...), .choice([...])
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, with this many alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(t): float(b) for t, b in (self.logit_bias or {}).items()})
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        self.spec(0)  # the engine's own bounds (top_logprobs, penalties, logit_bias, min_tokens)

    def spec(self, seed: int) -> SamplingSpec:
        """What the engine samples with."""
        bias = self.logit_bias or {}
        return SamplingSpec(temperature=0.0 if self.greedy else self.temperature, top_p=self.top_p, top_k=self.top_k,
                            seed=seed, logprobs=self.logprobs or self.top_logprobs > 0, top_logprobs=self.top_logprobs,
                            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty, logit_bias_ids=list(bias),
                            logit_bias_values=list(bias.values()), min_tokens=self.min_tokens,
                            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                            guided_kind=self.guided.kind if self.guided else "",
                            guided_spec=self.guided.spec if self.guided else "",
                            prompt_logprobs=-1 if self.prompt_logprobs is None else self.prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str
    top_logprobs: list[dict[int, float]] | None = None  # per token: the most likely token ids -> logprob
    # With SamplingParams.prompt_logprobs: each prompt token's logprob given those before it (None
    # for the first), and its alternatives (token id -> logprob; None for the first).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: str = "float32",
                 max_lora_rank: int = 256, lora_backend: str = "torch", num_pages: int | None = None,
                 pool_bytes: int | None = None, page_tokens: int | None = None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_batched_tokens: int = 2048, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, load_groups: int = 1,
                 load_throttle_bytes_s: float | None = None, cuda_graphs: bool = True,
                 admit_when_loaded: bool = False, load_format: str = "safetensors",
                 cpu_threads: int | None = None, cpu_packed_weights: bool = True) -> None:
        runtime = build_runtime(EngineSpec(
            model=None if model is None else str(model), load_format=load_format, device=device, dtype=dtype,
            max_lora_rank=max_lora_rank,
            lora_backend=lora_backend, num_pages=num_pages, pool_bytes=pool_bytes, page_tokens=page_tokens,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            load_throttle_bytes_s=load_throttle_bytes_s, cuda_graphs=cuda_graphs,
            # torch's thread count is the whole process's: an in-process engine keeps the caller's unless told
            cpu_threads=cpu_threads or torch.get_num_threads(), cpu_packed_weights=cpu_packed_weights,
        ), max_num_seqs=max_num_seqs)
        self.model_dir = runtime.model_dir
        self.device = runtime.executor.device
        self.dtype = runtime.executor.pool.data.dtype
        self.max_lora_rank = max_lora_rank
        self.config = runtime.config
        self.geometry = runtime.geometry
        self.executor = runtime.executor
        self.max_model_len = runtime.max_model_len
        num_pages = runtime.num_pages
        self.allocator = PageAllocator(num_pages)
        self.scheduler = FcfsScheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                            max_model_len=self.max_model_len, load_groups=load_groups,
                            max_loras_per_batch=0, admit_when_loaded=admit_when_loaded,
                            kv_window=kv_window(self.config.layer_windows)),
            self.geometry, self.allocator, self._adapter_pages, self.config.eos_token_ids,
        )
        self.tokenizer = self._load_tokenizer()
        self._ids = itertools.count()
        self.load_wait_ms = 0.0  # compute time spent waiting for adapter layer groups, all calls
        self._prompt_books: dict[str, PromptLogprobBook] = {}  # requests asking for prompt logprobs

    def _load_tokenizer(self):
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))

    # ---- adapters -------------------------------------------------------------------------------
    def add_adapter(self, name: str, peft_dir: str | Path) -> None:
        if not is_valid_name(name):
            raise AdapterError(f"adapter name {name!r} must be {NAME_RULE}")
        if name in self.executor.host:
            raise AdapterError(f"adapter {name!r} is already added; remove it first")
        adapter = load_peft_adapter(name, peft_dir, self.config, max_lora_rank=self.max_lora_rank, dtype=self.dtype)
        layout = self.executor.add_host_adapter(adapter)
        if layout.num_pages > self.allocator.num_pages:
            self.executor.remove_host_adapter(name)
            raise AdapterError(f"adapter {name!r} needs {layout.num_pages} pages; "
                               f"the pool has {self.allocator.num_pages}")

    def remove_adapter(self, name: str) -> None:
        if name not in self.executor.host:
            raise UnknownAdapterError(f"unknown adapter {name!r}")
        self.scheduler.adapters.drop(name)
        self.executor.remove_host_adapter(name)

    def adapters(self) -> list[str]:
        return sorted(self.executor.host)

    def _adapter_pages(self, name: str) -> int:
        return self.executor.host[name].layout.num_pages

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], adapters: str | None | Seq[str | None] = None,
                 sampling: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        adapter_list = list(adapters) if isinstance(adapters, (list, tuple)) else [adapters] * n
        sampling_list = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling or SamplingParams()] * n
        if len(adapter_list) != n or len(sampling_list) != n:
            raise ValueError(f"got {n} prompts, {len(adapter_list)} adapters and {len(sampling_list)} sampling params")
        requests = [self._make_request(p, a, s) for p, a, s in zip(prompt_list, adapter_list, sampling_list)]
        seqs: list[Sequence] = []
        self._prompt_books = {r.request_id: PromptLogprobBook(r.sampling.prompt_logprobs) for r in requests
                              if r.sampling.prompt_logprobs >= 0}
        try:
            for req in requests:
                seqs.append(self.scheduler.add(req))
            self._run_until_done()
        except BaseException:
            for seq in seqs:
                self.scheduler.abort(seq.request_id)
            raise
        return [self._output(seq) for seq in seqs]

    def _run_until_done(self) -> None:
        while self.scheduler.has_work():
            plan = self.scheduler.schedule()
            if plan is None:
                raise RuntimeError("scheduler made no progress with requests queued (pool too small?)")
            try:
                result = self.executor.execute(plan)
            except BaseException:
                self.scheduler.discard_inflight()
                raise
            self.load_wait_ms += result.load_wait_ms
            for chunk in result.prompt_logprobs:
                self._prompt_books[chunk.request_id].add(chunk)
            self.scheduler.apply(plan, result)

    def _make_request(self, prompt: Prompt, adapter: str | None, params: SamplingParams) -> SeqRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidTokenError(f"token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} (prompt + at least 1 new token)"
            )
        if adapter is not None and adapter not in self.executor.host:
            raise UnknownAdapterError(f"unknown adapter {adapter!r}; added: {self.adapters()}")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        bad = [t for t in (*(params.logit_bias or {}), *params.stop_token_ids) if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidTokenError(f"token id {bad[0]} in logit_bias or stop_token_ids is outside the vocabulary")
        spec = params.spec(seed)
        if params.guided is not None:  # refused here, with the compiler's reason, rather than mid-batch
            from loraplex.gpu_engine.grammar import GrammarError

            try:
                self.executor.sampler.grammars.compile(params.guided.kind, params.guided.spec)
            except GrammarError as exc:
                raise ValueError(str(exc)) from None
        return SeqRequest(request_id=f"offline-{next(self._ids)}", prompt_ids=ids, adapter=adapter, sampling=spec,
                          max_tokens=params.max_tokens, stop_token_ids=frozenset(params.stop_token_ids),
                          ignore_eos=params.ignore_eos)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json; pass token ids instead of text")
            return self.tokenizer.encode(prompt).ids
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidTokenError("a token-id prompt must be a list of integers")
        return list(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _output(self, seq: Sequence) -> RequestOutput:
        book = self._prompt_books.get(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            adapter=seq.req.adapter,
            prompt_token_ids=list(seq.req.prompt_ids),
            token_ids=list(seq.output_ids),
            text=self.decode(seq.output_ids),
            logprobs=[float(lp) for lp in seq.logprobs] if seq.req.sampling.logprobs else None,
            finish_reason=seq.finish_reason or "unknown",
            top_logprobs=list(seq.top_logprobs) if seq.req.sampling.top_logprobs else None,
            prompt_logprobs=[None, *book.logprobs] if book is not None else None,
            prompt_top_logprobs=[None, *(dict(zip(ids, lps)) for ids, lps in zip(book.top_ids, book.top_logprobs))]
            if book is not None and book.k else None,
        )


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one token-id prompt
    return prompts
