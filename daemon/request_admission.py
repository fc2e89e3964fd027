"""Request admission: the checks a generate request passes, its registration as in flight, its
prompt's way through the intake (text is bounded by size, then tokenized off the event loop),
its grammar's check (structured output: compiled within the limits by the grammar gate, off the
event loop and every engine's step), and its hand-over to an engine's scheduler, or to the
requests held for its adapter.

Torch-free.
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from loraplex.daemon.adapter_table import AdapterTable
from loraplex.daemon.choice_group import ChoiceGroup, sibling_key, sibling_seed
from loraplex.daemon.config import ServerSettings
from loraplex.daemon.controls import Controls
from loraplex.daemon.detokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer
from loraplex.daemon.engine_supervisor import EngineSupervisor
from loraplex.daemon.grammar_gate import GrammarGate
from loraplex.daemon.held_requests import HeldRequests
from loraplex.daemon.host_loads import HostLoader
from loraplex.daemon.host_service import HostTierService
from loraplex.daemon.intake import PromptIntake
from loraplex.daemon.prompt_logprobs import PromptLogprobBook, check_prompt_logprobs
from loraplex.daemon.rejected import Rejected
from loraplex.daemon.request_state import ClientRequest
from loraplex.daemon.request_table import RequestTable, request_key
from loraplex.daemon.scheduler.sequence import SeqRequest
from loraplex.daemon.stats import ServingStats
from loraplex.errors import CapacityError
from loraplex.ipc.engine_plan import SamplingSpec
from loraplex.ipc.errors import ErrorCode
from loraplex.ipc.protocol import EngineHello, GenerateRequest

log = logging.getLogger("loraplex.daemon")


class RequestAdmission:
    def __init__(self, server: ServerSettings, requests: RequestTable, adapters: AdapterTable,
                 engines: EngineSupervisor, held: HeldRequests, stats: ServingStats, controls: Controls,
                 host: HostTierService | None = None, loader: HostLoader | None = None,
                 grammars: GrammarGate | None = None) -> None:
        self.server = server
        self.requests = requests
        self.adapters = adapters
        self.engines = engines
        self.held = held
        self.stats = stats
        self.controls = controls
        self.host = host
        self.loader = loader
        self.grammars = grammars  # None: grammars are compiled by the engines alone (a stub engine's tests)
        self._checking: set[asyncio.Task] = set()  # requests whose new grammar is being compiled
        self.tokenizer = None
        self.intake = self._intake(None, 0, 0)  # replaced once an engine said what it runs

    def use_model(self, hello: EngineHello) -> None:
        """The model the engines run: its tokenizer and the bounds prompts are checked against.
        Once: a restarted engine runs the same model, and the intake's budgets must persist."""
        self.tokenizer = load_tokenizer(hello.model_dir)
        self.intake = self._intake(self.tokenizer, hello.max_model_len, hello.vocab_size)

    def _intake(self, tokenizer, max_model_len: int, vocab_size: int) -> PromptIntake:
        return PromptIntake(tokenizer, max_model_len, vocab_size, threads=self.server.tokenizer_threads,
                            max_queued_bytes_per_client=self.server.max_queued_prompt_bytes_per_client)

    async def submit(self, identity: bytes, msg: GenerateRequest) -> None:
        """Admit a request. Token ids are checked and routed now. A text prompt is bounded by its
        size now, then tokenized off the event loop (PromptIntake) and routed, or failed with an
        error reply, when its tokens are known; it counts as in flight meanwhile."""
        key = request_key(identity, msg.request_id)
        self._check_room(identity, key, msg)
        self._check_adapter(msg)
        if self.intake.vocab_size:  # known once an engine said what it runs
            self.intake.check_vocab(msg.bias_lists()[0], "logit_bias")
            self.intake.check_vocab(msg.stop_token_ids, "stop_token_ids")
        if msg.prompt is None:
            max_tokens = self.intake.check_ids(msg.prompt_token_ids, msg.max_tokens)  # before copying them
            check_prompt_logprobs(msg, len(msg.prompt_token_ids))
            ids = list(msg.prompt_token_ids)
            states = self._register_choices(identity, key, msg)
            if self._grammar_known(msg):  # answered at once (a remembered refusal too)
                await self._check_then_route(states, ids, max_tokens)
            else:  # its compile may take seconds: the dispatcher goes on meanwhile
                task = asyncio.create_task(self._check_then_route(states, ids, max_tokens), name=f"grammar-{key}")
                self._checking.add(task)
                task.add_done_callback(self._checking.discard)
        else:
            self.intake.check_text(msg.prompt)
            states = self._register_choices(identity, key, msg)
            self.requests.tokenizing[key] = asyncio.create_task(self._tokenize_then_route(states), name=f"intake-{key}")

    def _register_choices(self, identity: bytes, key: str, msg: GenerateRequest) -> list[ClientRequest]:
        """One request in flight per choice (n > 1: siblings that one reply ends)."""
        states = [self._register(identity, sibling_key(key, i), msg, choice=i) for i in range(msg.n)]
        if msg.n > 1:
            self.requests.add_group(ChoiceGroup(key, msg.n))
        return states

    def _check_room(self, identity: bytes, key: str, msg: GenerateRequest) -> None:
        if self.controls.draining:
            raise Rejected(ErrorCode.SHUTTING_DOWN, "the daemon is draining and accepts no new requests")
        # Each of n choices is one request in flight.
        if len(self.requests) + msg.n > self.server.max_clients_inflight:
            raise Rejected(ErrorCode.OVERLOADED, f"{len(self.requests)} requests in flight; try again later")
        per_client = self.requests.per_client(identity)
        if per_client + msg.n > self.server.max_requests_per_client:
            raise Rejected(ErrorCode.OVERLOADED,
                           f"this client already has {per_client} requests in flight and asks for {msg.n} more "
                           "(server.max_requests_per_client)")
        if key in self.requests:
            raise Rejected(ErrorCode.DUPLICATE_REQUEST, f"request id {msg.request_id!r} is already in flight")

    def _check_adapter(self, msg: GenerateRequest) -> None:
        if msg.adapter is not None:
            entry = self.adapters.get(msg.adapter)
            if entry is None:
                raise Rejected(ErrorCode.UNKNOWN_ADAPTER, f"unknown adapter {msg.adapter!r}")
            if entry.state == "error" or (entry.state != "ready" and self.host is None):
                raise Rejected(ErrorCode.INVALID_ADAPTER, f"adapter {msg.adapter!r} is not usable: {entry.error}")

    def _register(self, identity: bytes, key: str, msg: GenerateRequest, choice: int = 0) -> ClientRequest:
        state = ClientRequest(
            key=key, identity=identity, msg=msg, prompt_ids=[], choice=choice,
            detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
            stops=StopStringMatcher(list(msg.stop)) if msg.stop else None,
            adapter_path="base" if msg.adapter is None else "cached",
            prompt_book=PromptLogprobBook(msg.prompt_logprobs) if msg.prompt_logprobs is not None and choice == 0
            else None,
        )
        self.requests.add(state)
        return state

    async def _tokenize_then_route(self, states: list[ClientRequest]) -> None:
        state = states[0]
        try:
            ids = await self.intake.encode(state.identity, state.msg.prompt)
            max_tokens = self.intake.check_ids(ids, state.msg.max_tokens)
            check_prompt_logprobs(state.msg, len(ids))
            self._check_adapter(state.msg)  # it may have been removed while the prompt was tokenized
        except Rejected as exc:
            await self.requests.fail(state.key, ErrorCode(exc.code), exc.message)
            return
        except Exception as exc:  # a tokenizer failure fails this request only
            log.exception("tokenizing request %s failed", state.request_id)
            await self.requests.fail(state.key, ErrorCode.INTERNAL,
                                     f"internal error: cannot tokenize the prompt: {exc}")
            return
        finally:
            self.requests.tokenizing.pop(state.key, None)
        await self._check_then_route(states, ids, max_tokens)

    def _grammar_known(self, msg: GenerateRequest) -> bool:
        """No grammar to check, or its verdict is at hand (GrammarGate.known)."""
        return not msg.guided_kind or self.grammars is None or self.grammars.known(msg.guided_kind, msg.guided_spec)

    async def _check_then_route(self, states: list[ClientRequest], ids: list[int], max_tokens: int) -> None:
        """Route the request once its grammar is known to compile within the limits (the gate's
        verdict, cached by grammar); fail it with the verdict's code and reason otherwise."""
        msg, first = states[0].msg, states[0]
        if msg.guided_kind and self.grammars is not None:
            try:
                verdict = await self.grammars.check(msg.guided_kind, msg.guided_spec)
            except Rejected as exc:
                await self.requests.fail(first.key, ErrorCode(exc.code), exc.message)
                return
            except Exception as exc:  # a bug fails this request, never the dispatcher
                log.exception("checking the grammar of request %s failed", first.request_id)
                await self.requests.fail(first.key, ErrorCode.INTERNAL,
                                         f"internal error: cannot check the grammar: {exc}")
                return
            if verdict.code is not None:
                await self.requests.fail(first.key, verdict.code, verdict.message)  # and its siblings
                return
        await self._route_all(states, ids, max_tokens)

    async def _route_all(self, states: list[ClientRequest], ids: list[int], max_tokens: int) -> None:
        for state in states:
            if state.key in self.requests:  # cancelled meanwhile, or a sibling's failure failed them all
                await self._route(state, ids, max_tokens)

    async def _route(self, state: ClientRequest, ids: list[int], max_tokens: int) -> None:
        """Hand a checked request to an engine's scheduler (or hold it for its adapter)."""
        msg = state.msg
        state.prompt_ids = ids
        seq = _sequence_request(state.key, msg, ids, max_tokens, state.choice)
        adapter = self.adapters.get(msg.adapter) if msg.adapter is not None else None
        if adapter is not None and self.host is not None:
            self.host.note_tier(adapter.name)
        if adapter is not None and adapter.replacing:
            self.held.hold(adapter.name, seq)  # routed once the new weights are in
            self.requests.departed.set()  # a replace counting the old weights' users: this one waits for the new
        elif adapter is not None and self.loader is not None and self.host.needs_load(adapter.name):
            self.loader.hold(adapter.name, seq)  # on disk: routed once the host store holds it
        else:
            try:
                slot = self.engines.place(seq)
            except CapacityError as exc:
                await self.requests.fail(state.key, ErrorCode.TOO_LARGE, str(exc))
                return
            if adapter is not None and slot.scheduler is not None:
                slot.scheduler.adapters.note_arrival(adapter.name)
        self.stats.accepted(msg.adapter)
        if adapter is not None:
            adapter.requests += 1


def _sequence_request(key: str, msg: GenerateRequest, ids: list[int], max_tokens: int, choice: int) -> SeqRequest:
    """What the scheduler sees of a client request (or of its choice `choice`)."""
    bias_ids, bias_values = msg.bias_lists()
    seed = sibling_seed(msg.seed, choice)
    return SeqRequest(
        request_id=key, prompt_ids=ids, adapter=msg.adapter,
        sampling=SamplingSpec(temperature=msg.temperature if msg.top_k != 1 else 0.0, top_p=msg.top_p,
                              top_k=msg.top_k, seed=seed if seed is not None else secrets.randbits(63),
                              logprobs=msg.logprobs or msg.top_logprobs > 0, top_logprobs=msg.top_logprobs,
                              presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                              repetition_penalty=msg.repetition_penalty, logit_bias_ids=bias_ids,
                              logit_bias_values=bias_values, min_tokens=msg.min_tokens,
                              stop_token_ids=list(msg.stop_token_ids) if msg.min_tokens else [],
                              ignore_eos=msg.ignore_eos, guided_kind=msg.guided_kind or "",
                              guided_spec=msg.guided_spec,
                              # choice 0 alone scores the prompt (its siblings' would be the same)
                              prompt_logprobs=msg.prompt_logprobs if msg.prompt_logprobs is not None and choice == 0
                              else -1),
        max_tokens=max_tokens, stop_token_ids=frozenset(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        ttft_slo_s=None if msg.slo_ttft_ms is None else msg.slo_ttft_ms / 1e3,
    )
