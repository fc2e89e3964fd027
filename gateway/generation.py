"""The daemon requests behind one HTTP request: one streamed generate per
prompt (its n choices fanned out by the daemon) through the shared AsyncClient, their first replies awaited before
any HTTP byte is sent (so a refused request still gets its proper status),
their chunks merged in arrival order, and their outcomes counted.

Knows nothing of HTTP or OpenAI JSON; raises LoraplexError / ValueError as
the client library does.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from loraplex.gateway.metrics import GatewayMetrics, Ticket
from loraplex.gateway.schema import Prompt, Sampling
from loraplex.ipc.client import AsyncClient, AsyncStream, Choice, GenerateResult, StreamChunk

Event = tuple[int, StreamChunk]


class Run:
    """One prompt's streamed generate, with its first chunk peeked."""

    def __init__(self, stream: AsyncStream, ticket: Ticket) -> None:
        self._stream = stream
        self._ticket = ticket
        self._first: StreamChunk | None = None

    async def begin(self) -> None:
        """Send the request and wait for its first reply; raises the daemon's refusal."""
        try:
            self._first = await self._stream.__anext__()
            self._ticket.running()
        except StopAsyncIteration:
            self._first = None

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for chunk in self._stream:
            self._ticket.running()
            yield chunk

    @property
    def result(self) -> GenerateResult | None:
        return self._stream.result

    async def close(self) -> None:
        """Cancel the request on the daemon if it has not finished; forget it."""
        self._ticket.done()
        await self._stream.aclose()


class Job:
    """All generations of one HTTP request: `start()`, read `events()`, then
    always `close()`, which cancels whatever is unfinished and counts each
    generation that finished."""

    def __init__(self, client: AsyncClient, metrics: GatewayMetrics, *, model: str, adapter: str | None,
                 prompts: Sequence[Prompt], sampling: Sampling, timeout: float | None) -> None:
        self._client = client
        self._metrics = metrics
        self.model = model
        self._adapter = adapter
        self._prompts = list(prompts)
        self._sampling = sampling
        self._timeout = timeout
        self._runs: list[Run] = []

    async def start(self) -> None:
        """Start every generation and await each one's first reply. On failure
        (the daemon's LoraplexError, or ValueError for an out-of-range field)
        everything started is cancelled before the error propagates."""
        kwargs = self._sampling.client_kwargs()
        try:
            for prompt in self._prompts:
                stream = self._client.stream(prompt, self._adapter, timeout=self._timeout, **kwargs)
                self._runs.append(Run(stream, self._metrics.in_flight.start(self.model, self._adapter)))
            # return_exceptions: the other first replies are still awaited (no orphaned waits) before raising.
            outcomes = await asyncio.gather(*(run.begin() for run in self._runs), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:
            await self._close_runs()
            self._runs = []
            raise

    async def close(self) -> None:
        await self._close_runs()
        for run in self._runs:
            if run.result is not None:
                self._metrics.finished(self.model, run.result)
        self._runs = []

    async def _close_runs(self) -> None:
        await asyncio.gather(*(run.close() for run in self._runs), return_exceptions=True)

    @property
    def choices(self) -> list[Choice]:
        """Every choice, prompt by prompt (OpenAI's index: prompt * n + choice), once `events()` ended."""
        return [choice for result in self.results for choice in result.choices]

    @property
    def results(self) -> list[GenerateResult]:
        """Each prompt's result, in prompt order (after `events()` was read to its end)."""
        out = []
        for run in self._runs:
            if run.result is None:
                raise RuntimeError("results are known only once every stream has ended")
            out.append(run.result)
        return out

    async def events(self) -> AsyncIterator[Event]:
        """(choice index: prompt * n + choice, chunk) in arrival order until every generation ended."""
        n = self._sampling.n
        if len(self._runs) == 1:
            async for chunk in self._runs[0].chunks():
                yield chunk.choice, chunk
            return
        queue: asyncio.Queue[tuple[int, StreamChunk | None, Exception | None]] = asyncio.Queue()

        async def pump(index: int, run: Run) -> None:
            try:
                async for chunk in run.chunks():
                    queue.put_nowait((index, chunk, None))
                queue.put_nowait((index, None, None))
            except Exception as exc:  # handed to the reader, which raises it
                queue.put_nowait((index, None, exc))

        tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(self._runs)]
        try:
            remaining = len(tasks)
            while remaining:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    remaining -= 1
                else:
                    yield index * n + chunk.choice, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
