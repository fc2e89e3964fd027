"""The daemon's side of one grammar compile worker (`loraplex-grammar`): a ChildLink whose
child runs gpu_engine/grammar_worker.py and answers with a GrammarWorkerHello. Torch-free."""
from __future__ import annotations

from loraplex.daemon.child_link import ChildLink
from loraplex.ipc.protocol import GrammarWorkerHello


class GrammarWorkerLink(ChildLink):
    CHILD_MODULE = "loraplex.gpu_engine.grammar_worker"
    ENDPOINT_NAME = "grammar"
    HELLO_TYPE = GrammarWorkerHello
