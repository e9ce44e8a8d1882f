"""Sans-IO protocol core: message codecs, bootstrap payloads, room state machines, rank
mapping, and the per-role cores (``PrefillCore``, ``DecodeCore``) that decide every rule.

Nothing here imports asyncio, zmq, aiohttp, nixl or uvloop (a test enforces it); time
is always a parameter (``now``), never read.
"""

from .actions import (
    Action,
    CancelPosts,
    ChunkPosted,
    Closed,
    ConnectPeer,
    DisconnectPeer,
    FetchTopology,
    Finished,
    ForgetEndpoint,
    InitDone,
    PeerDown,
    PeerUp,
    Post,
    RoomReady,
    Send,
    SetLease,
)
from .bootstrap import PayloadError, PrefillRank, RankTable
from .decode import DecodeCore
from .messages import (
    PROTOCOL_VERSION,
    Abort,
    Bye,
    Message,
    Ping,
    Pong,
    Register,
    RegisterResult,
    Status,
    TransferInfo,
    VersionMismatch,
    decode,
    encode,
)
from .prefill import PrefillCore
from .receiver import ReceiverRoom
from .sender import DecodePeer, SenderRoom
from .states import (
    RECEIVER_POLL,
    RECEIVER_TRANSITIONS,
    SENDER_POLL,
    SENDER_TRANSITIONS,
    Event,
    KVPoll,
    ReceiverState,
    SenderState,
)
from .topology import PrefillInstance, TargetPlan, check_compatible, check_registration, plan_targets

__all__ = [
    "PROTOCOL_VERSION",
    "RECEIVER_POLL",
    "RECEIVER_TRANSITIONS",
    "SENDER_POLL",
    "SENDER_TRANSITIONS",
    "Abort",
    "Action",
    "Bye",
    "CancelPosts",
    "ChunkPosted",
    "Closed",
    "ConnectPeer",
    "DecodeCore",
    "DecodePeer",
    "DisconnectPeer",
    "Event",
    "FetchTopology",
    "Finished",
    "ForgetEndpoint",
    "InitDone",
    "KVPoll",
    "Message",
    "PayloadError",
    "PeerDown",
    "PeerUp",
    "Ping",
    "Pong",
    "Post",
    "PrefillCore",
    "PrefillInstance",
    "PrefillRank",
    "RankTable",
    "ReceiverRoom",
    "ReceiverState",
    "Register",
    "RegisterResult",
    "RoomReady",
    "Send",
    "SenderRoom",
    "SenderState",
    "SetLease",
    "Status",
    "TargetPlan",
    "TransferInfo",
    "VersionMismatch",
    "check_compatible",
    "check_registration",
    "decode",
    "encode",
    "plan_targets",
]
