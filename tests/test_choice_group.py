"""The n choices of one generate in the daemon's request table: one `done` for all of
them (merged usage and choices), one `error` when any fails, nothing left behind."""
from __future__ import annotations

import asyncio

from loraplex.daemon.choice_group import ChoiceGroup, sibling_key, sibling_seed
from loraplex.daemon.request_state import ClientRequest
from loraplex.daemon.request_table import RequestTable, request_key
from loraplex.daemon.stats import ServingStats
from loraplex.ipc.engine_plan import RowResult
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import DoneReply, ErrorReply, GenerateRequest

IDENTITY = b"\x01client"


def _table(n: int, sent: list) -> tuple[RequestTable, str, list[str]]:
    async def send(identity: bytes, msg) -> None:
        sent.append(msg)

    table = RequestTable(send, ServingStats())
    msg = GenerateRequest(request_id="r1", prompt_token_ids=[5, 6], n=n, stream=True)
    key = request_key(IDENTITY, "r1")
    keys = [sibling_key(key, i) for i in range(n)]
    for i, k in enumerate(keys):
        table.add(ClientRequest(key=k, identity=IDENTITY, msg=msg, prompt_ids=[5, 6], detok=None, stops=None,
                                choice=i))
    table.add_group(ChoiceGroup(key, n))
    return table, key, keys


def test_one_done_merges_every_choice() -> None:
    async def run() -> list:
        sent: list = []
        table, key, keys = _table(3, sent)
        for i, k in enumerate(keys):
            table[k].on_token(RowResult(request_id=k, token_id=10 + i, logprob=None))
        await table.finish(keys[2], "length")
        await table.finish(keys[0], "stop")
        assert not [m for m in sent if isinstance(m, DoneReply)]  # one choice still runs
        await table.finish(keys[1], "length")
        assert len(table) == 0 and table.per_client(IDENTITY) == 0 and table.idle.is_set() and not table._groups
        return sent

    done = [m for m in asyncio.run(run()) if isinstance(m, DoneReply)]
    assert len(done) == 1
    reply = done[0]
    assert [c.finish_reason for c in reply.choices] == ["stop", "length", "length"]
    assert [c.token_ids for c in reply.choices] == [[10], [11], [12]]
    assert reply.finish_reason == "stop" and reply.token_ids == [10]
    assert reply.usage["completion_tokens"] == 3 and reply.usage["prompt_tokens"] == 2


def test_a_failed_choice_fails_the_request_once() -> None:
    async def run() -> tuple[list, RequestTable]:
        sent: list = []
        table, key, keys = _table(3, sent)
        await table.finish(keys[0], "length")
        await table.fail(keys[1], ErrorCode.TIMEOUT, "the request's deadline passed")
        await table.fail(keys[2], ErrorCode.TIMEOUT, "again")  # already gone: no second reply
        return sent, table

    sent, table = asyncio.run(run())
    assert [type(m) for m in sent] == [ErrorReply]
    assert len(table) == 0 and table.per_client(IDENTITY) == 0 and not table._groups


def test_cancel_ends_every_choice() -> None:
    async def run() -> list:
        sent: list = []
        table, key, keys = _table(3, sent)
        await table.finish(keys[0], "length")  # choice 0 is done; cancelling still reaches the others
        assert await table.cancel(IDENTITY, "r1")
        assert len(table) == 0 and not table._groups
        assert not await table.cancel(IDENTITY, "r1")
        return sent

    done = [m for m in asyncio.run(run()) if isinstance(m, DoneReply)]
    assert len(done) == 1 and [c.finish_reason for c in done[0].choices] == ["length", "cancelled", "cancelled"]


def test_a_client_gone_leaves_no_group_behind() -> None:
    async def run() -> RequestTable:
        table, key, keys = _table(2, [])
        await table.finish(keys[0], "length")
        await table.client_gone(IDENTITY)
        return table

    table = asyncio.run(run())
    assert len(table) == 0 and not table._groups


def test_sibling_keys_and_seeds() -> None:
    assert sibling_key("k/r", 0) == "k/r" and sibling_key("k/r", 2) == "k/r 2"
    assert sibling_seed(None, 3) is None and sibling_seed(7, 2) == 9 and sibling_seed(2**63 - 1, 1) == 0
