"""The loraplex wire protocol: every message type, the registry, the version.

The single import point for message classes and their bounds, for every module
outside `loraplex.ipc.messages`: importing it loads every declaration module
there, so the registry that `codec.decode` consults is complete whichever
message a process imported first. Adding a message type is one `@register`-ed
dataclass in one of those modules, each field declared with its rules (plus its
import below when the module is new). Holds no I/O and no serving logic.
"""
from __future__ import annotations

from loraplex.ipc.messages.admin import (
    MAX_DRAIN_TIMEOUT_S,
    POLICY_KINDS,
    AddAdapterRequest,
    AdminOkReply,
    DrainRequest,
    PauseRequest,
    PinAdapterRequest,
    PolicyKind,
    RemoveAdapterRequest,
    SetPolicyRequest,
)
from loraplex.ipc.messages.base import (
    PROTOCOL_VERSION,
    RESERVED_KEYS,
    Message,
    build,
    message_class,
    message_types,
    register,
)
from loraplex.ipc.messages.cache import CacheHello, CacheStoreFull
from loraplex.ipc.messages.checks import MAX_PATH_LEN, MAX_REQUEST_ID_LEN, MAX_TOKEN_ID, is_valid_request_id
from loraplex.ipc.messages.client import (
    MAX_CHOICES,
    MAX_DEADLINE_MS,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    CancelRequest,
    DetokenizeRequest,
    GenerateRequest,
    ListAdaptersRequest,
    PingRequest,
    StatsRequest,
    TokenizeRequest,
)
from loraplex.ipc.messages.cpu import (
    FAILURE_CODES as CPU_FAILURE_CODES,
)
from loraplex.ipc.messages.cpu import (
    CpuCalibrate,
    CpuCalibration,
    CpuJobDone,
    CpuJobSlice,
    CpuLoraJob,
    CpuWorkerFailure,
    CpuWorkerHello,
    CpuWorkerShutdown,
)
from loraplex.ipc.messages.engine import (
    EngineAdapterLoaded,
    EngineFailure,
    EngineHello,
    EngineLoadAdapter,
    EngineShutdown,
    EngineStep,
    EngineStepDelta,
    EngineStepDone,
    EngineUnloadAdapter,
)
from loraplex.ipc.messages.grammar import GrammarCompile, GrammarCompiled, GrammarWorkerHello
from loraplex.ipc.messages.replies import (
    ADAPTER_PATHS,
    FINISH_REASONS,
    MAX_ERROR_MESSAGE_LEN,
    MAX_TOKEN_TEXT_LEN,
    AdaptersReply,
    ChoiceOutcome,
    DetokenizedReply,
    DoneReply,
    ErrorReply,
    PongReply,
    PromptLogprobs,
    StatsReply,
    TokenChunk,
    TokenizedReply,
    TopLogprobs,
)

# The requests each socket accepts; the daemon answers anything else with
# `error` (unknown_type) rather than routing admin work through the client
# socket.
CLIENT_REQUESTS: tuple[type[Message], ...] = (
    GenerateRequest,
    TokenizeRequest,
    DetokenizeRequest,
    CancelRequest,
    ListAdaptersRequest,
    StatsRequest,
    PingRequest,
)
ADMIN_REQUESTS: tuple[type[Message], ...] = (
    AddAdapterRequest,
    RemoveAdapterRequest,
    PinAdapterRequest,
    DrainRequest,
    SetPolicyRequest,
    PauseRequest,
    ListAdaptersRequest,
    StatsRequest,
    PingRequest,
)

__all__ = [
    "CPU_FAILURE_CODES",
    "CpuCalibrate",
    "CpuCalibration",
    "CpuJobDone",
    "CpuJobSlice",
    "CpuLoraJob",
    "CpuWorkerFailure",
    "CpuWorkerHello",
    "CpuWorkerShutdown",
    "CacheHello",
    "CacheStoreFull",
    "EngineAdapterLoaded",
    "EngineFailure",
    "EngineHello",
    "EngineLoadAdapter",
    "EngineShutdown",
    "EngineStep",
    "EngineStepDelta",
    "EngineStepDone",
    "EngineUnloadAdapter",
    "GrammarCompile",
    "GrammarCompiled",
    "GrammarWorkerHello",
    "ADAPTER_PATHS",
    "ADMIN_REQUESTS",
    "CLIENT_REQUESTS",
    "FINISH_REASONS",
    "MAX_CHOICES",
    "MAX_DEADLINE_MS",
    "MAX_DRAIN_TIMEOUT_S",
    "MAX_ERROR_MESSAGE_LEN",
    "MAX_TOKEN_TEXT_LEN",
    "MAX_NEW_TOKENS",
    "MAX_PATH_LEN",
    "MAX_PROMPT_TOKEN_IDS",
    "MAX_REQUEST_ID_LEN",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LEN",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKEN_ID",
    "POLICY_KINDS",
    "PolicyKind",
    "PROTOCOL_VERSION",
    "RESERVED_KEYS",
    "AdaptersReply",
    "AddAdapterRequest",
    "AdminOkReply",
    "CancelRequest",
    "ChoiceOutcome",
    "DetokenizeRequest",
    "DetokenizedReply",
    "DoneReply",
    "DrainRequest",
    "ErrorReply",
    "GenerateRequest",
    "ListAdaptersRequest",
    "Message",
    "PauseRequest",
    "PinAdapterRequest",
    "PingRequest",
    "PongReply",
    "PromptLogprobs",
    "RemoveAdapterRequest",
    "SetPolicyRequest",
    "StatsReply",
    "StatsRequest",
    "TokenChunk",
    "TokenizeRequest",
    "TokenizedReply",
    "TopLogprobs",
    "build",
    "is_valid_request_id",
    "message_class",
    "message_types",
    "register",
]
