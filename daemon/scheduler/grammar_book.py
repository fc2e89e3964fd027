"""Which structured-output grammars one engine has compiled, as its step results said, and which
to order it to compile (torch-free).

A guided request waits in the queue while its engine compiles its grammar off the step
(StepPlan.grammars -> StepResult.grammars_ready, gpu_engine/grammar.py), as a request waits
for its adapter's copy: the batch runs on meanwhile, and when nothing else would run it is
admitted at once (its first step then waits for the compile, stalling no one). Its limits
were checked before it was queued (daemon/grammar_gate.py). A new engine is a new scheduler,
hence a new book: nothing is taken as compiled there.
"""
from __future__ import annotations

from collections import OrderedDict

from loraplex.ipc.engine_plan import MAX_COMPILED_GRAMMARS, GrammarOrder, SamplingSpec
from loraplex.ipc.guided import grammar_key


class GrammarBook:
    def __init__(self, limit: int = MAX_COMPILED_GRAMMARS) -> None:
        # As many as the engine keeps: one it may have let go is compiled again when its row is sampled.
        self.limit = limit
        self.compiled: OrderedDict[str, None] = OrderedDict()  # grammar keys, least recently used first
        self._ordered: dict[str, GrammarOrder] = {}  # ordered from the engine, not reported yet
        self._orders: list[GrammarOrder] = []  # for the next plan
        self._keys: dict[tuple[str, str], str] = {}  # (kind, spec) -> key, so a planning pass hashes no spec

    def must_wait(self, spec: SamplingSpec, busy: bool) -> bool:
        """Whether a request sampling with `spec` waits in the queue for its grammar (ordering it
        when it is not yet): only when its engine has not reported it compiled and something
        else runs (`busy`)."""
        if not spec.guided_kind:
            return False
        pair = (spec.guided_kind, spec.guided_spec)
        key = self._keys.get(pair)
        if key is None:
            if len(self._keys) >= 4 * self.limit:
                self._keys.clear()
            key = self._keys[pair] = grammar_key(*pair)
        if key in self.compiled:
            self.compiled.move_to_end(key)
            return False
        if key not in self._ordered:
            self._ordered[key] = GrammarOrder(*pair)
            self._orders.append(self._ordered[key])
        return busy

    def take_orders(self) -> list[GrammarOrder]:
        """The grammars the next plan orders compiled."""
        orders, self._orders = self._orders, []
        return orders

    def reported(self, keys: list[str]) -> None:
        """A step result's grammars_ready."""
        for key in keys:
            if self._ordered.pop(key, None) is not None or key in self.compiled:
                self.compiled[key] = None
                self.compiled.move_to_end(key)
        while len(self.compiled) > self.limit:
            self.compiled.popitem(last=False)

    def lost(self) -> None:
        """The plans in flight were refused: what they ordered is ordered again by the next one."""
        self._ordered.clear()
        self._orders = []
