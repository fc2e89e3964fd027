"""The daemon's side of one engine process (`loraplex-engine`): a ChildLink whose child runs
gpu_engine/engine_process.py and answers with an EngineHello. Torch-free."""
from __future__ import annotations

from loraplex.daemon.child_link import ChildLink
from loraplex.ipc.protocol import EngineHello


class EngineLink(ChildLink):
    CHILD_MODULE = "loraplex.gpu_engine.engine_process"
    ENDPOINT_NAME = "engine"
    HELLO_TYPE = EngineHello
