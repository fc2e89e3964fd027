"""Fault injection for tests only: makes the engine's forward raise on chosen steps.

Off unless LORAPLEX_FAULTS is set in the engine's environment; never set it in
production. The value is a comma-separated list of `KIND=N[xK]` (the Nth forward
of this process and the K-1 after it fail) and `file=PATH` (a test writes such a
list into PATH at run time; the engine takes it, counting from its next forward,
and deletes it, so exactly one engine fires it once). KIND is `step_raise` (a
RuntimeError) or `step_oom` (torch.cuda.OutOfMemoryError, constructible on CPU); and
`token_raise=T`: from then on every forward whose batch feeds token id T raises (a fault
that one request's row carries, for the engine's row isolation to find).
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.gpu_engine.model.batch import ForwardBatch

ENV = "LORAPLEX_FAULTS"
KINDS = ("step_raise", "step_oom", "token_raise")
_ITEM = re.compile(r"(?P<kind>[a-z_]+)=(?P<at>[1-9][0-9]*)(?:x(?P<times>[1-9][0-9]*))?")


def parse_faults(spec: str) -> dict[str, tuple[int, int]]:
    """`{kind: (first forward, how many)}` from `KIND=N[xK],...`; ValueError on anything else."""
    faults: dict[str, tuple[int, int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _ITEM.fullmatch(item)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(f"{ENV}: cannot read {item!r}; expected KIND=N[xK] with KIND in {KINDS}, or file=PATH")
        faults[match["kind"]] = (int(match["at"]), int(match["times"] or 1))
    return faults


class FaultInjector:
    def __init__(self, spec: str) -> None:
        items = [part.strip() for part in spec.split(",")]
        files = [item[len("file="):] for item in items if item.startswith("file=")]
        self.path = files[-1] if files else None
        self.forwards = 0
        self.faults = {kind: (at, times) for kind, (at, times) in
                       parse_faults(",".join(i for i in items if not i.startswith("file="))).items()}

    def _take_armed(self) -> None:
        """A spec written to the fault file arms faults counted from this forward."""
        if self.path is None:
            return
        taken = f"{self.path}.{os.getpid()}"
        try:
            os.rename(self.path, taken)  # atomic: one engine takes it
        except OSError:
            return
        try:
            with open(taken) as f:
                armed = parse_faults(f.read())
        finally:
            os.unlink(taken)
        for kind, (at, times) in armed.items():
            self.faults[kind] = (at if kind == "token_raise" else self.forwards + at, times)

    def before_forward(self, batch: ForwardBatch | None = None) -> None:
        self.forwards += 1
        self._take_armed()
        for kind, (at, times) in self.faults.items():
            if kind == "token_raise":
                if batch is not None and bool((batch.token_ids == at).any()):
                    raise RuntimeError(f"injected fault: forward {self.forwards} feeds token {at}")
            elif at <= self.forwards < at + times:
                if kind == "step_oom":
                    raise torch.cuda.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate 2.00 GiB (injected fault, forward {self.forwards})")
                raise RuntimeError(f"injected fault: forward {self.forwards} raised")


def install_faults(model, env: dict[str, str] | os._Environ = os.environ) -> FaultInjector | None:
    """Wrap `model.forward` when LORAPLEX_FAULTS is set; None (and nothing changed) otherwise."""
    spec = env.get(ENV)
    if not spec:
        return None
    injector = FaultInjector(spec)
    forward = model.forward

    def faulty_forward(*args, **kwargs):
        injector.before_forward(args[0] if args else kwargs.get("batch"))
        return forward(*args, **kwargs)

    model.forward = faulty_forward
    return injector
