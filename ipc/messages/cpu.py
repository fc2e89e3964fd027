"""Messages between the daemon's CPU worker pool and its worker processes.

Owns the declarations only: a worker's hello, LoRA jobs (which exchange rows,
which adapter entry in the host store, which layers), their completion and
failures, calibration, shutdown. Tensors never travel here: a job names
shared-memory segments and offsets, and the worker reads the bytes in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from loraplex.ipc.adapter_store import STORE_ARENA_BASE, StoreEntry
from loraplex.ipc.exchange import ExchangeLayout
from loraplex.ipc.messages.base import Message, register
from loraplex.ipc.messages.checks import UINT63_MAX, Checked, InRange, Length, invalid
from loraplex.ipc.shm import check_segment_name

MAX_JOB_SLICES = 4096
MAX_WORKERS = 4096
MAX_DEADLINE_MS = 600_000
MAX_CALIBRATION_RANK = 1024
MAX_CALIBRATION_TOKENS = 65_536
# Failure codes a worker reports (CpuWorkerFailure.code).
FailureCode = Literal["timeout", "aborted", "stale", "invalid_job", "internal", "start_failed"]
FAILURE_CODES: tuple[str, ...] = get_args(FailureCode)
DeadlineMs = Annotated[int, InRange(1, MAX_DEADLINE_MS)]


@dataclass(frozen=True, slots=True)
class CpuJobSlice:
    """Exchange rows [token_start, token_start + token_count) run `entry`'s adapter.

    `entry` is the adapter's placed StoreEntry; its modules are the adapter's
    target modules, so the worker writes exactly those out regions.
    `cpu_layers`: the rows are on the CPU path for layers [0, cpu_layers) only
    (RowPlan.cpu_layers); at the job's later layers the worker skips them but
    still signals every site. None: every layer of the job.
    """

    token_start: int
    token_count: int
    entry: StoreEntry
    scaling: float
    cpu_layers: int | None = None

    def __post_init__(self) -> None:
        if self.token_start < 0 or self.token_count < 1:
            raise ValueError(f"slice rows must be token_start >= 0 and token_count >= 1, got "
                             f"{self.token_start}, {self.token_count}")
        if self.cpu_layers is not None and self.cpu_layers < 1:
            raise ValueError(f"cpu_layers must be >= 1 (or None), got {self.cpu_layers}")
        if not self.entry.placed:
            raise ValueError(f"store entry {self.entry.name!r} is not placed (offset -1)")

    @property
    def token_end(self) -> int:
        return self.token_start + self.token_count


@register
@dataclass(frozen=True, slots=True)
class CpuWorkerHello(Message):
    """First message of a started worker, once pinned and ready for jobs."""

    TYPE = "cpu_worker_hello"
    index: Annotated[int, InRange(0, MAX_WORKERS - 1)]
    pid: Annotated[int, InRange(1, 2**31 - 1)]
    core: Annotated[int, InRange(0, 65_535)]
    torch_threads: int = 1


@register
@dataclass(frozen=True, slots=True)
class CpuLoraJob(Message):
    """Compute the LoRA deltas of `slices` for every layer in `layers`, all four stages.

    For site = layer*4 + stage the worker waits until the exchange's ready word
    reaches `seq` (at most `start_deadline_ms` for the first site,
    `deadline_ms` for each later one), writes its rows of the stage's out
    regions for every target module, then adds 1 to the site's done word.
    It drops the job (failure `aborted`) when the exchange's control word
    moves away from `generation` (None: its value when the job arrives), and
    (failure `stale`) when a ready word passes `seq`, i.e. a later step reused
    the site. Store offsets count from `arena_base` bytes into segment `store`.
    """

    TYPE = "cpu_lora_job"
    job_id: Annotated[int, InRange(0, UINT63_MAX)]
    seq: Annotated[int, InRange(1, UINT63_MAX)]
    exchange: ExchangeLayout
    store: Annotated[str, Checked(check_segment_name)]
    layers: list[int]
    slices: Annotated[list[CpuJobSlice], Length(1, MAX_JOB_SLICES)]
    deadline_ms: DeadlineMs = 2000
    start_deadline_ms: DeadlineMs = 10_000
    generation: Annotated[int, InRange(0, UINT63_MAX)] | None = None
    arena_base: Annotated[int, InRange(0, UINT63_MAX)] = STORE_ARENA_BASE

    def validate(self) -> None:
        num_layers = self.exchange.num_layers
        Length(1, num_layers)(self.layers, "layers")
        if any(not 0 <= layer < num_layers for layer in self.layers):
            raise invalid(f"layers: every layer must be in [0, {num_layers}), got {self.layers[:16]}")
        if any(b <= a for a, b in zip(self.layers, self.layers[1:])):
            raise invalid("layers: must be strictly increasing (the forward order)")
        end = 0
        for i, piece in enumerate(sorted(self.slices, key=lambda s: s.token_start)):
            if piece.token_start < end:
                raise invalid(f"slices: rows overlap at exchange row {piece.token_start}")
            end = piece.token_end
            if end > self.exchange.max_tokens:
                raise invalid(f"slices[{i}]: rows end at {end}, the exchange holds {self.exchange.max_tokens}")
            entry = piece.entry
            if entry.num_layers != num_layers:
                raise invalid(f"slices[{i}]: adapter {entry.name!r} has {entry.num_layers} layers, "
                              f"the model {num_layers}")
            for module in entry.staged_modules:
                if module.name not in self.exchange.module_names:
                    raise invalid(f"slices[{i}]: {entry.name!r} targets {module.name}, which this model's "
                                  f"exchange has no slot for (it has {', '.join(self.exchange.module_names)})")
                shape = self.exchange.module_shape(module.name)
                if (module.in_features, module.out_features) != shape:
                    raise invalid(f"slices[{i}]: {entry.name!r} {module.name} is "
                                  f"{module.in_features}x{module.out_features}, the model's is {shape[0]}x{shape[1]}")

    @property
    def tokens(self) -> int:
        return sum(s.token_count for s in self.slices)

    @property
    def max_duration_ms(self) -> int:
        """The longest a healthy worker can take: every wait at its deadline."""
        return self.start_deadline_ms + (4 * len(self.layers) - 1) * self.deadline_ms


@register
@dataclass(frozen=True, slots=True)
class CpuJobDone(Message):
    """Job `job_id` signalled every site. busy_ms: compute; wait_ms: waiting for ready words."""

    TYPE = "cpu_job_done"
    job_id: int
    index: int
    busy_ms: float
    tokens: int
    wait_ms: float = 0.0
    sites: int = 0


@register
@dataclass(frozen=True, slots=True)
class CpuWorkerFailure(Message):
    """A job (`job_id`), a calibration (`calibration_id`) or the worker itself (both None)
    failed; `code` is one of FAILURE_CODES. `fatal`: the worker is exiting (it is restarted)."""

    TYPE = "cpu_worker_failure"
    index: int
    code: FailureCode
    message: str
    job_id: int | None = None
    fatal: bool = False
    calibration_id: int | None = None


@register
@dataclass(frozen=True, slots=True)
class CpuCalibrate(Message):
    """Measure the single-thread LoRA kernel on this worker's core: token-modules per
    second of a hidden x hidden module, `tokens` rows, for each rank."""

    TYPE = "cpu_calibrate"
    request_id: int
    hidden: Annotated[int, InRange(1, 65_536)]
    ranks: Annotated[list[Annotated[int, InRange(1, MAX_CALIBRATION_RANK)]], Length(1, 64)]
    tokens: Annotated[int, InRange(1, MAX_CALIBRATION_TOKENS)] = 256
    repeats: Annotated[int, InRange(1, 1000)] = 5
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@register
@dataclass(frozen=True, slots=True)
class CpuCalibration(Message):
    """The answer to CpuCalibrate: tokens_per_s[i] is for ranks[i]."""

    TYPE = "cpu_calibration"
    request_id: int
    index: int
    hidden: int
    tokens: int
    ranks: list[int]
    tokens_per_s: list[float]
    dtype: str = "float32"
    cpu_model: str = ""
    torch_version: str = ""

    def validate(self) -> None:
        if len(self.ranks) != len(self.tokens_per_s):
            raise invalid("tokens_per_s: one value per rank")


@register
@dataclass(frozen=True, slots=True)
class CpuWorkerShutdown(Message):
    TYPE = "cpu_worker_shutdown"
