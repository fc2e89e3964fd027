"""The daemon's side of one engine process (`loraplex-engine`): a ChildLink whose child runs
gpu_engine/engine_process.py and answers with an EngineHello. Torch-free."""
from __future__ import annotations

from dataclasses import replace

from loraplex.contracts.engine_spec import EngineSpec
from loraplex.daemon.child_link import ChildLink
from loraplex.ipc.protocol import EngineHello


class EngineLink(ChildLink):
    CHILD_MODULE = "loraplex.gpu_engine.engine_process"
    ENDPOINT_NAME = "engine"
    HELLO_TYPE = EngineHello
    PLAN_DELTAS = True  # the engine keeps a persistent batch (ipc/plan_delta.py)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The cache manager's host store, attached at each start (EngineSlot.attach_store); "": none,
        # the engine makes its own where it needs one.
        self.store_segment = ""

    def child_spec(self) -> EngineSpec:
        """Which of the daemon's engines this is (`cuda` means GPU replica mod GPU count), and the store."""
        return replace(self.spec, replica=self.index, host_store_segment=self.store_segment)
