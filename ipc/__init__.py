"""loraplex.ipc: the wire protocol and the sockets that carry it.

Messages are typed, validated dataclasses (protocol), encoded as one msgpack
map each with bounded decoding (codec), sent over ZMQ through one typed
wrapper (sockets) at endpoints derived from a private runtime directory
(runtime_dir). Pure Python + msgpack + pyzmq: this package must never import
torch or numpy, so clients and policy code stay light.
"""
from __future__ import annotations

from loraplex.ipc.codec import DEFAULT_LIMITS, DecodeLimits, decode, encode
from loraplex.ipc.errors import ErrorCode, LoraplexError, ProtocolError
from loraplex.ipc.protocol import (
    PROTOCOL_VERSION,
    AdaptersReply,
    AddAdapterRequest,
    AdminOkReply,
    CancelRequest,
    DoneReply,
    DrainRequest,
    ErrorReply,
    GenerateRequest,
    ListAdaptersRequest,
    Message,
    PauseRequest,
    PinAdapterRequest,
    PingRequest,
    PongReply,
    RemoveAdapterRequest,
    SetPolicyRequest,
    StatsReply,
    StatsRequest,
    TokenChunk,
    message_types,
    register,
)
from loraplex.ipc.runtime_dir import (
    Endpoints,
    RuntimeDirError,
    default_runtime_dir,
    endpoints,
    ensure_runtime_dir,
    instance_id,
    ipc_endpoint,
)
from loraplex.ipc.socket_options import DEFAULT_SOCKET_LIMITS, EndpointInUse, SocketKind, SocketLimits
from loraplex.ipc.sockets import (
    AsyncTypedSocket,
    Envelope,
    PeerUnavailable,
    TypedSocket,
    make_dealer,
    make_pub,
    make_router,
    make_sub,
    open_socket,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_SOCKET_LIMITS",
    "PROTOCOL_VERSION",
    "AdaptersReply",
    "AddAdapterRequest",
    "AdminOkReply",
    "AsyncTypedSocket",
    "CancelRequest",
    "DecodeLimits",
    "DoneReply",
    "DrainRequest",
    "EndpointInUse",
    "Endpoints",
    "Envelope",
    "ErrorCode",
    "ErrorReply",
    "GenerateRequest",
    "ListAdaptersRequest",
    "LoraplexError",
    "Message",
    "PeerUnavailable",
    "PinAdapterRequest",
    "PingRequest",
    "PongReply",
    "ProtocolError",
    "RemoveAdapterRequest",
    "RuntimeDirError",
    "SetPolicyRequest",
    "PauseRequest",
    "SocketKind",
    "SocketLimits",
    "StatsReply",
    "StatsRequest",
    "TokenChunk",
    "TypedSocket",
    "decode",
    "default_runtime_dir",
    "encode",
    "endpoints",
    "ensure_runtime_dir",
    "instance_id",
    "ipc_endpoint",
    "make_dealer",
    "make_pub",
    "make_router",
    "make_sub",
    "message_types",
    "open_socket",
    "register",
]
