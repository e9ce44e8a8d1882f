"""Sans-IO protocol core: message codecs, bootstrap payloads, room states, rank mapping.

Nothing here imports asyncio, zmq, aiohttp, nixl or uvloop (a test enforces it); time
is always a parameter.
"""

from .bootstrap import PayloadError, PrefillRank, RankTable
from .messages import (
    PROTOCOL_VERSION,
    Abort,
    Message,
    Register,
    RegisterResult,
    Status,
    TransferInfo,
    VersionMismatch,
    decode,
    encode,
)
from .states import TRANSITIONS, Event, KVPoll, RoomState, Side
from .topology import PrefillInstance, TargetPlan, check_compatible, check_registration, plan_targets

__all__ = [
    "PROTOCOL_VERSION",
    "TRANSITIONS",
    "Abort",
    "Event",
    "KVPoll",
    "Message",
    "PayloadError",
    "PrefillInstance",
    "PrefillRank",
    "RankTable",
    "Register",
    "RegisterResult",
    "RoomState",
    "Side",
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
