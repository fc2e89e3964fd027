"""The requests in flight: each client request by its key (client identity + request id),
how many each client has, their deadline timers and prompts being tokenized, and every way a
request leaves (finished, failed, cancelled, its client gone), each with exactly one reply.

Torch-free and socket-free: replies go out through the `send` callback the server gives the
serving core. A request that leaves is dropped wherever it waits through `on_forget` (its
engine's queues, the requests held for an adapter).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping, ValuesView
from typing import Awaitable, Callable

from loraplex.daemon.choice_group import ChoiceGroup
from loraplex.daemon.request_state import ClientRequest
from loraplex.daemon.stats import ServingStats
from loraplex.ipc.engine_plan import StepPlan, StepResult
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import ErrorReply, Message, TokenChunk

Send = Callable[[bytes, Message], Awaitable[None]]


def request_key(identity: bytes, request_id: str) -> str:
    return identity.hex() + "/" + request_id


def _row_error_code(value: str) -> ErrorCode:
    """The code a failed row's request fails with: the engine's (empty: a grammar that did not
    compile, invalid_field); one this daemon does not know is an internal error."""
    try:
        return ErrorCode.parse(value) if value else ErrorCode.INVALID_FIELD
    except ValueError:
        return ErrorCode.INTERNAL


class RequestTable(Mapping[str, ClientRequest]):
    def __init__(self, send: Send, stats: ServingStats) -> None:
        self._send = send
        self.stats = stats
        self._requests: dict[str, ClientRequest] = {}
        self._per_client: dict[bytes, int] = {}  # identity -> requests in flight
        self._deadlines: dict[str, asyncio.TimerHandle] = {}  # key -> its deadline_ms timer
        self.tokenizing: dict[str, asyncio.Task] = {}  # key -> its prompt being tokenized
        self._groups: dict[str, ChoiceGroup] = {}  # each sibling's key -> its request's n choices (n > 1)
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self.departed = asyncio.Event()  # set whenever a request leaves
        # Drop a leaving request wherever it still waits (set by the serving core).
        self.on_forget: Callable[[str], None] = lambda key: None

    # ---- the mapping ---------------------------------------------------------------------------
    def __getitem__(self, key: str) -> ClientRequest:
        return self._requests[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    # The dict's own, faster than Mapping's generic ones (the step loop asks per row).
    def __contains__(self, key: object) -> bool:
        return key in self._requests

    def get(self, key: str, default: ClientRequest | None = None) -> ClientRequest | None:
        return self._requests.get(key, default)

    def values(self) -> ValuesView[ClientRequest]:
        return self._requests.values()

    def per_client(self, identity: bytes) -> int:
        return self._per_client.get(identity, 0)

    def client_id(self, key: str) -> str:
        """The id the client gave the request (the key itself once it is gone)."""
        state = self._requests.get(key)
        return state.request_id if state is not None else key

    def users(self, adapter: str) -> list[str]:
        return [key for key, state in self._requests.items() if state.msg.adapter == adapter]

    def adapters_in_use(self) -> set[str]:
        return {state.msg.adapter for state in self._requests.values() if state.msg.adapter}

    # ---- arrival -------------------------------------------------------------------------------
    def add(self, state: ClientRequest) -> None:
        """In flight from here: cancel, disconnect, deadline and drain see it."""
        self._requests[state.key] = state
        self._per_client[state.identity] = self.per_client(state.identity) + 1
        self.idle.clear()
        if state.msg.deadline_ms is not None:
            self._deadlines[state.key] = asyncio.get_running_loop().call_later(
                state.msg.deadline_ms / 1e3, self.expire, state.key)

    def add_group(self, group: ChoiceGroup) -> None:
        """The n sibling requests of one generate (added each with `add`): one reply ends them all."""
        for key in group.keys:
            self._groups[key] = group

    def note_scheduled(self, plan: StepPlan, waited_for_adapter: Callable[[str], bool]) -> None:
        """A step is about to run: record when each request first ran and how its adapter got there."""
        placed = {p.name for p in plan.place}
        now = time.monotonic()
        for row in plan.rows:
            state = self._requests.get(row.request_id)
            if state is not None and state.first_scheduled is None:
                state.first_scheduled = now
                state.cached_tokens = row.start_pos  # a first row starts past what the prefix cache held
                if plan.merged_adapter is not None and row.adapter == plan.merged_adapter:
                    state.adapter_path = "merged"
                elif row.cpu_layers:
                    state.adapter_path = "cpu_assisted"
                elif row.adapter in placed or waited_for_adapter(row.request_id):
                    state.adapter_path = "loaded"

    async def deliver(self, result: StepResult, finished: dict[str, str | None]) -> None:
        """Stream a step's tokens to their clients; finish what the scheduler finished (`finished`:
        key -> reason) and what hit a stop string."""
        for chunk in result.prompt_logprobs:
            state = self._requests.get(chunk.request_id)
            if state is not None and state.prompt_book is not None:
                state.prompt_book.add(chunk)
        for row in result.rows:
            state = self._requests.get(row.request_id)
            if state is None:
                continue
            if row.error:  # this row alone failed on the engine (the rest of its step ran)
                await self.fail(row.request_id, _row_error_code(row.error_code), row.error)
                continue
            if state.first_token_at is None:
                state.first_step_engine_ms = result.forward_ms + result.sample_ms
            chunk, stopped = state.on_token(row)
            if chunk is not None:
                await self.send(state.identity, chunk)
            if stopped:
                finished[row.request_id] = "stop"
                self._forget(row.request_id)
        for key, reason in finished.items():
            if key in self._requests:
                await self.finish(key, reason or "stop", stopped_by_string=reason == "stop")
        self.stats.tokens += len(result.rows)

    # ---- departure -----------------------------------------------------------------------------
    async def finish(self, key: str, reason: str, *, stopped_by_string: bool = False) -> None:
        state = self._leave(key)
        if state is None:
            return
        tail = state.finish_text(stopped=stopped_by_string and state.stops is not None and reason == "stop")
        if state.msg.stream and tail:
            await self.send(state.identity, TokenChunk(request_id=state.request_id, token_ids=[], text=tail,
                                                       index=len(state.token_ids), choice=state.choice))
        # A prompt's logprobs are detokenized token by token (and each alternative): thousands of
        # decodes for a long prompt, which would stall every stream if run on the loop.
        scored = await asyncio.to_thread(state.scored_prompt) if state.prompt_book is not None else None
        done = state.done(reason, scored)
        self.stats.finished(done)
        group = self._groups.get(key)
        if group is not None:
            done = group.finished(state.choice, done)
            if done is not None:  # the last choice: the request is over
                for sibling in group.keys:
                    self._groups.pop(sibling, None)
        if done is not None:
            await self.send(state.identity, done)
        self._check_idle()

    async def fail(self, key: str, code: ErrorCode, message: str) -> None:
        """One error reply; a sibling's failure fails its whole request (the others go silently)."""
        group = self._groups.get(key)
        for sibling in group.keys if group is not None else ():
            self._groups.pop(sibling, None)
            if sibling != key:
                self._leave(sibling)
        state = self._leave(key)
        if state is None:
            return
        self.stats.errors += 1
        await self.send(state.identity, ErrorReply(request_id=state.request_id, code=code.value, message=message))
        self._check_idle()

    async def cancel(self, identity: bytes, request_id: str) -> bool:
        key = request_key(identity, request_id)
        group = self._groups.get(key)  # choice 0 may have finished while the others run
        if key not in self._requests and group is None:
            return False
        for sibling in group.keys if group is not None else [key]:
            if sibling in self._requests:
                await self.finish(sibling, "cancelled")
        return True

    async def client_gone(self, identity: bytes) -> None:
        """Its connection closed: its requests go without a reply."""
        prefix = identity.hex() + "/"
        for key in [k for k in self._groups if k.startswith(prefix)]:
            del self._groups[key]
        for key in [k for k in self._requests if k.startswith(prefix)]:
            self._forget(key)
            self._requests.pop(key, None)
            self.stats.cancelled += 1
        self._per_client.pop(identity, None)
        self._check_idle()

    def expire(self, key: str) -> None:
        """Its deadline_ms passed."""
        self._deadlines.pop(key, None)
        if key in self._requests:
            asyncio.ensure_future(self.fail(key, ErrorCode.TIMEOUT, "the request's deadline passed"))

    async def send(self, identity: bytes, msg: Message) -> None:
        try:
            await self._send(identity, msg)
        except ConnectionError:
            await self.client_gone(identity)

    def _leave(self, key: str) -> ClientRequest | None:
        state = self._requests.pop(key, None)
        if state is not None:
            left = self.per_client(state.identity) - 1
            if left > 0:
                self._per_client[state.identity] = left
            else:
                self._per_client.pop(state.identity, None)
            self._forget(key)
        return state

    def _forget(self, key: str) -> None:
        task = self.tokenizing.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # its prompt bytes stay counted until the tokenizer thread is done with them
        timer = self._deadlines.pop(key, None)
        if timer is not None:  # a finished request's timer would hold its key until the deadline
            timer.cancel()
        self.on_forget(key)

    def _check_idle(self) -> None:
        self.departed.set()
        if not self._requests:
            self.idle.set()
