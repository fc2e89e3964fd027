"""The tokens each request with penalties or a grammar has seen, kept by the engine from the
plans it runs.

A row feeds `token_ids` at positions `start_pos..`; a row starting at 0 (a new
request, or one recomputed after preemption or on another engine) starts over,
so the history is always exactly the KV the engine computed: prompt, then
output. At a sampling row the context holds prompt + the `sample_index` tokens
sampled before, which is how the output is told from the prompt without any
extra field on the wire. Bounded: the least recently fed requests are dropped
past `max_requests` (plans do not yet say which requests finished).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

from loraplex.ipc.engine_plan import RowPlan

DEFAULT_MAX_REQUESTS = 4096


class SamplingHistory:
    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self._seqs: OrderedDict[str, array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seqs)

    def feed(self, row: RowPlan) -> None:
        """Record the tokens this row feeds."""
        seq = self._seqs.get(row.request_id)
        if row.start_pos == 0 or seq is None:
            if row.start_pos != 0:
                raise ValueError(f"row {row.request_id}: sampling history starts at position {row.start_pos}; "
                                 f"this engine never saw the tokens before it")
            seq = self._seqs[row.request_id] = array("i")
        elif row.start_pos > len(seq):
            raise ValueError(f"row {row.request_id}: feeds position {row.start_pos} after only {len(seq)} tokens")
        del seq[row.start_pos:]
        seq.extend(row.token_ids)
        self._seqs.move_to_end(row.request_id)
        while len(self._seqs) > self.max_requests:
            self._seqs.popitem(last=False)

    def split(self, row: RowPlan) -> tuple[array, int]:
        """(the row's whole context, where its output starts) once the row was fed."""
        seq = self._seqs[row.request_id]
        return seq, len(seq) - row.sample_index

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._seqs.pop(request_id, None)
