"""Daemon → engine step plans and engine → daemon step results.

The contract between policy (daemon, torch-free) and execution (gpu_engine):
the plan says which tokens run, where their KV lives, which adapter each row
uses and which adapters to place in which pages. Plain data only — tensors
never appear here, so the same objects travel over ZMQ as msgpack maps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Bounds of the sampling options (one source: the client message declares its fields with these).
MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's limit
# Prompt logprobs (vLLM's prompt_logprobs): prompt tokens x (1 + alternatives) one request may ask
# for, so its `done` reply stays a few MiB under the codec's message limit.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY]; 1 disables it
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_MIN_TOKENS = 1_000_000
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing logits by less would
# overflow them to inf and the probabilities to NaN. Any temperature in [0, MAX_TEMPERATURE] is valid input.
SAMPLING_EPS = 1e-5
# Structured output: what constrains a row's tokens (vLLM's guided decoding). The spec is a JSON
# schema (json_schema), a regular expression (regex), a JSON list of strings (choice), or empty
# (json_object: any JSON object).
GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice")
MAX_GUIDED_SPEC = 64 * 1024
MAX_GUIDED_CHOICES = 256
# A spec nesting deeper than this (JSON objects and arrays, regex groups) is refused before any
# parser or compiler sees it (grammar_too_complex): compile time grows steeply with depth.
MAX_GUIDED_DEPTH = 128
# Compiled grammars an engine keeps (least recently used out); the daemon remembers as many as compiled.
MAX_COMPILED_GRAMMARS = 256


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """Per-request sampling; temperature 0 (or below SAMPLING_EPS) means greedy. Stateless: the engine
    derives the random stream of token k from (seed, k), so a recomputed request
    samples the same tokens.

    The logits are processed in this order before temperature, top-k and top-p:
    `logit_bias` (token id -> bias, as two lists) is added; while fewer than
    `min_tokens` tokens were sampled, EOS (unless `ignore_eos`) and
    `stop_token_ids` are masked; then repetition_penalty (vLLM/HF: a seen
    token's positive logit is divided by it, a negative one multiplied; prompt
    and output count as seen), frequency_penalty (times the token's count in
    the output) and presence_penalty (once per token present in the output)
    are subtracted; a guided row (guided_kind, guided_spec) then masks every
    token its grammar does not allow. `logprobs` and the `top_logprobs`
    alternatives (0..20) are those of the model's raw distribution, before any
    of that (vLLM's default). `prompt_logprobs` (-1: none; else 0..20 alternatives) asks for
    each prompt token's logprob given the tokens before it, from the same raw distribution.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    guided_kind: str = ""  # "" or one of GUIDED_KINDS
    guided_spec: str = ""
    prompt_logprobs: int = -1

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not -1 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be -1 (none) or in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [{-MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                             f"got {self.repetition_penalty}")
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            raise ValueError("logit_bias_ids and logit_bias_values must have the same length")
        if len(self.logit_bias_ids) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        if any(not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in self.logit_bias_values):
            raise ValueError(f"logit_bias values must be in [{-MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        if not 0 <= self.min_tokens <= MAX_MIN_TOKENS:
            raise ValueError(f"min_tokens must be in [0, {MAX_MIN_TOKENS}], got {self.min_tokens}")
        if self.guided_kind not in ("",) + GUIDED_KINDS:
            raise ValueError(f"guided_kind must be one of {GUIDED_KINDS}, got {self.guided_kind[:32]!r}")
        if len(self.guided_spec) > MAX_GUIDED_SPEC:
            raise ValueError(f"guided_spec: at most {MAX_GUIDED_SPEC} characters")

    @property
    def greedy(self) -> bool:
        """The most likely token is taken: temperature below SAMPLING_EPS, or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether sampling needs the tokens this request has seen (penalties, a grammar's state)."""
        return self.penalised or bool(self.guided_kind)

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before temperature (penalties, bias, min_tokens, a grammar)."""
        return self.penalised or bool(self.logit_bias_ids) or self.min_tokens > 0 or bool(self.guided_kind)


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One sequence in one step: `token_ids` are fed at positions
    `start_pos .. start_pos+len-1`; `kv_pages` is its whole page table."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    kv_pages: list[int]
    adapter: str | None
    sample: bool
    sampling: SamplingSpec
    sample_index: int = 0  # how many tokens this request has sampled before
    # CPU-assisted prefill (docs/architecture.md, "The per-layer CPU/GPU protocol"): layers
    # [0, cpu_layers) of this row's LoRA delta are computed by CPU workers; its tokens occupy
    # exchange rows [cpu_row, cpu_row + len(token_ids)).
    cpu_layers: int = 0
    cpu_row: int = 0
    # Prompt logprobs (sampling.prompt_logprobs): the first `prompt_scored` positions of this row
    # each score the prompt token after them; the last of them scores `prompt_next` when it is
    # the row's last token (the prompt's next token, fed by a later chunk; -1 when not needed).
    prompt_scored: int = 0
    prompt_next: int = -1


@dataclass(frozen=True, slots=True)
class AdapterPlacement:
    """Copy adapter `name` from the host store into `pages` (see loraplex.contracts.geometry)."""

    name: str
    pages: list[int]
    # Load as this many layer groups, each signalling when it is in the pool (1: all at once).
    load_groups: int = 1


@dataclass(frozen=True, slots=True)
class CpuAssistStep:
    """The CPU side of one step: workers wait for ready words to reach `seq`;
    `workers_per_layer[l]` workers add 1 to each done word of layer l."""

    seq: int
    workers_per_layer: list[int]
    exchange_rows: int


@dataclass(frozen=True, slots=True)
class GrammarOrder:
    """Compile this grammar off the step (a guided request waits in the queue until a step
    result lists it in `grammars_ready`; ipc.guided.grammar_key names it)."""

    kind: str
    spec: str


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    rows: list[RowPlan]
    place: list[AdapterPlacement] = field(default_factory=list)
    evict: list[str] = field(default_factory=list)
    cpu: CpuAssistStep | None = None
    merged_adapter: str | None = None  # dLoRA merged mode: this adapter is folded into the base weights
    grammars: list[GrammarOrder] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def prefill_tokens(self) -> int:
        """Tokens beyond one per row: the prefill work this step adds to a decode step."""
        return self.num_tokens - len(self.rows)


@dataclass(frozen=True, slots=True)
class RowResult:
    request_id: str
    token_id: int
    logprob: float | None
    # The `top_logprobs` most likely tokens of the raw distribution, most likely first (empty when not asked).
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # This row failed, and with it its request (the rest of the step ran): why, and the ErrorCode
    # value to fail it with ("" reads as invalid_field: a grammar that did not compile).
    error: str = ""
    error_code: str = ""


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    """Logprobs of one request's prompt tokens `first`, `first`+1, ..., each given the tokens
    before it (vLLM's prompt_logprobs), from one step's row: `ranks` (1: the most likely token)
    beside them, and per token the `prompt_logprobs` most likely alternatives, most likely first
    (empty lists when none were asked). The first prompt token has no logprob, so first >= 1."""

    request_id: str
    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    rows: list[RowResult]
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    # CPU-assist sites whose workers missed the deadline (the engine computed those deltas itself).
    cpu_timeouts: int = 0
    load_wait_ms: float = 0.0  # compute time spent waiting for adapter layer groups to arrive
    # Bytes moved over the host<->device link in this step, by purpose:
    # adapter_h2d (layer-group loads), assist_d2h (activations to the CPU workers), assist_h2d (their deltas).
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    # Adapters placed by this or earlier plans whose layer groups are still arriving after this step.
    loading: list[str] = field(default_factory=list)
    # Grammars (their ipc.guided.grammar_key) ordered by plans whose compile ended since the last step.
    grammars_ready: list[str] = field(default_factory=list)
    # Prompt logprobs the step's rows computed (rows that asked for them: RowPlan.prompt_scored).
    prompt_logprobs: list[PromptLogprobChunk] = field(default_factory=list)
