"""The serving core's request admission: the checks a generate request passes, its
registration as in flight, its prompt's way through the intake (text is bounded by size,
then tokenized off the event loop), and its hand-over to an engine's scheduler.

Torch-free; mixed into ServingCore (daemon/serving.py) like its sibling serving_* modules.
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from loraplex.daemon.detokenizer import IncrementalDetokenizer, StopStringMatcher
from loraplex.daemon.request_state import ClientRequest
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.daemon.serving_adapters import Rejected
from loraplex.errors import CapacityError
from loraplex.ipc.engine_plan import SamplingSpec
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import GenerateRequest

log = logging.getLogger("loraplex.daemon")


class RequestAdmission:
    """Needs from its host class: config, requests, adapters, intake, tokenizer, replicas, stats,
    host_tier, _per_client, _idle, _deadlines, _intake, _held, _departed, _fail, _deadline and the
    host tier's _note_tier, _needs_host_load and _hold_for_host."""

    async def submit(self, identity: bytes, msg: GenerateRequest) -> None:
        """Admit a request. Token ids are checked and routed now. A text prompt is bounded by its
        size now, then tokenized off the event loop (PromptIntake) and routed, or failed with an
        error reply, when its tokens are known; it counts as in flight meanwhile."""
        if self.draining:
            raise Rejected(ErrorCode.SHUTTING_DOWN, "the daemon is draining and accepts no new requests")
        if len(self.requests) >= self.config.server.max_clients_inflight:
            raise Rejected(ErrorCode.OVERLOADED, f"{len(self.requests)} requests in flight; try again later")
        key = request_key(identity, msg.request_id)
        per_client = self._per_client.get(identity, 0)
        if per_client >= self.config.server.max_requests_per_client:
            raise Rejected(ErrorCode.OVERLOADED,
                           f"this client already has {per_client} requests in flight (server.max_requests_per_client)")
        if key in self.requests:
            raise Rejected(ErrorCode.DUPLICATE_REQUEST, f"request id {msg.request_id!r} is already in flight")
        self._check_adapter(msg)
        if msg.prompt is None:
            max_tokens = self.intake.check_ids(msg.prompt_token_ids, msg.max_tokens)  # before copying them
            await self._route(self._register(identity, key, msg), list(msg.prompt_token_ids), max_tokens)
        else:
            self.intake.check_text(msg.prompt)
            state = self._register(identity, key, msg)
            self._intake[key] = asyncio.create_task(self._tokenize_then_route(state), name=f"intake-{key}")

    def _check_adapter(self, msg: GenerateRequest) -> None:
        if msg.adapter is not None:
            entry = self.adapters.get(msg.adapter)
            if entry is None:
                raise Rejected(ErrorCode.UNKNOWN_ADAPTER, f"unknown adapter {msg.adapter!r}")
            if entry.state == "error" or (entry.state != "ready" and self.host_tier is None):
                raise Rejected(ErrorCode.INVALID_ADAPTER, f"adapter {msg.adapter!r} is not usable: {entry.error}")

    def _register(self, identity: bytes, key: str, msg: GenerateRequest) -> ClientRequest:
        """The request counts as in flight from here: cancel, disconnect, deadline and drain see it."""
        state = ClientRequest(
            key=key, identity=identity, msg=msg, prompt_ids=[],
            detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
            stops=StopStringMatcher(list(msg.stop)) if msg.stop else None,
            adapter_path="base" if msg.adapter is None else "cached",
        )
        self.requests[key] = state
        self._per_client[identity] = self._per_client.get(identity, 0) + 1
        self._idle.clear()
        if msg.deadline_ms is not None:
            self._deadlines[key] = asyncio.get_running_loop().call_later(msg.deadline_ms / 1e3, self._deadline, key)
        return state

    async def _tokenize_then_route(self, state: ClientRequest) -> None:
        try:
            ids = await self.intake.encode(state.identity, state.msg.prompt)
            max_tokens = self.intake.check_ids(ids, state.msg.max_tokens)
            self._check_adapter(state.msg)  # it may have been removed while the prompt was tokenized
        except Rejected as exc:
            await self._fail(state.key, ErrorCode(exc.code), exc.message)
            return
        except Exception as exc:  # a tokenizer failure fails this request only
            log.exception("tokenizing request %s failed", state.request_id)
            await self._fail(state.key, ErrorCode.INTERNAL, f"internal error: cannot tokenize the prompt: {exc}")
            return
        finally:
            self._intake.pop(state.key, None)
        if state.key in self.requests:
            await self._route(state, ids, max_tokens)

    async def _route(self, state: ClientRequest, ids: list[int], max_tokens: int) -> None:
        """Hand a checked request to an engine's scheduler (or hold it for its adapter)."""
        msg, key = state.msg, state.key
        state.prompt_ids = ids
        seq = SeqRequest(
            request_id=key, prompt_ids=ids, adapter=msg.adapter,
            sampling=SamplingSpec(temperature=msg.temperature if msg.top_k != 1 else 0.0, top_p=msg.top_p,
                                  top_k=msg.top_k, seed=msg.seed if msg.seed is not None else secrets.randbits(63),
                                  logprobs=msg.logprobs),
            max_tokens=max_tokens, stop_token_ids=frozenset(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            ttft_slo_s=None if msg.slo_ttft_ms is None else msg.slo_ttft_ms / 1e3,
        )
        if msg.adapter is not None and self.host_tier is not None:
            self._note_tier(msg.adapter)
        if msg.adapter is not None and self.adapters.get(msg.adapter).replacing:
            self._held.setdefault(msg.adapter, []).append(seq)  # routed once the new weights are in
            self._departed.set()  # a replace counting the old weights' users: this one waits for the new
        elif msg.adapter is not None and self._needs_host_load(msg.adapter):
            self._hold_for_host(msg.adapter, seq)  # on disk: routed once the host store holds it
        else:
            slot = self.replicas.choose(seq, self.adapters)
            try:
                slot.enqueue(seq)
            except CapacityError as exc:
                await self._fail(key, ErrorCode.TOO_LARGE, str(exc))
                return
            state.engine = slot.index
            if msg.adapter is not None and slot.scheduler is not None:
                slot.scheduler.adapters.note_arrival(msg.adapter)
        self.stats.accepted(msg.adapter)
        if msg.adapter is not None:
            self.adapters.get(msg.adapter).requests += 1


def request_key(identity: bytes, request_id: str) -> str:
    return identity.hex() + "/" + request_id
