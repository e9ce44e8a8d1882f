"""What a core asks its pump to do. Cores return these; they never do I/O themselves.

The pump (``asynckv.service``) runs each action in order: ``Send`` on the control channel
(ordered per peer), ``Post``/``CancelPosts``/``SetLease``/``ConnectPeer``/``DisconnectPeer``
on the data plane, ``FetchTopology`` over HTTP, and resolves the awaitables of rooms on
``RoomReady``, ``ChunkPosted``, ``InitDone`` and ``Finished``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .messages import Message
from .sglang import SglangMessage

if TYPE_CHECKING:
    from .decode_staging import StagedSlice
    from .receiver import ReceiverRoom
    from .sender import DecodePeer, SenderRoom

__all__ = [
    "Action",
    "CancelPosts",
    "ChunkPosted",
    "Closed",
    "ConnectPeer",
    "DisconnectPeer",
    "FetchTopology",
    "Finished",
    "ForgetEndpoint",
    "InitDone",
    "PeerDown",
    "PeerUp",
    "Post",
    "RoomReady",
    "Scatter",
    "Send",
    "SetLease",
]


class Action:
    """Base of every action."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Send(Action):
    """Send a control message; messages to one endpoint leave in the order they were asked for."""

    endpoint: str
    msg: Message | SglangMessage
    """A message of the manager's wire: asynckv's own, or SGLang's (``Config.wire``)."""
    transient: bool = False
    """A reply to an endpoint nobody vouched for (a refused registration, a ping of an unknown
    session): sent through a small, rate-limited pool of sockets, never kept open for it."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Post(Action):
    """Write part of a room into a decode peer. The data plane must settle every post exactly once
    (landed, failed, cancelled, lease lapsed or past ``timeout_s``) and report it with
    ``post_settled``; until then the room cannot report its outcome."""

    post_id: int
    peer: str
    room: int
    epoch: int
    kind: str
    """"kv" (pages), "aux" (one row) or "state" (hybrid state slots or pages)."""
    src: npt.NDArray[np.int64]
    """Prefill page indices, ``[aux row]`` or state indices."""
    dst: npt.NDArray[np.int64]
    """The matching decode page indices, ``[aux row]`` or state indices."""
    nbytes: int
    timeout_s: float
    notif: bytes = b""
    """NIXL notification sent with the write's last handle (SGLang's wire), or none."""
    aux: tuple[int, int] | None = None
    """(prefill row, decode row) of the room's aux row, written after the pages of this "kv" write
    (the last chunk's pages and its aux row to the same decode rank are one post; ``nbytes``
    counts both)."""


@dataclasses.dataclass(frozen=True, slots=True)
class CancelPosts(Action):
    """Cancel these posts (before they are posted, or in flight); each still settles, with ``reason``."""

    post_ids: tuple[int, ...]
    reason: BaseException


@dataclasses.dataclass(frozen=True, slots=True)
class SetLease(Action):
    """Posts to ``peer`` may write until ``until`` (monotonic seconds); after it they are cancelled."""

    peer: str
    until: float


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ConnectPeer(Action):
    """Import a decode peer's NIXL metadata and prepare its destination; answer with ``peer_connected``."""

    peer: DecodePeer


@dataclasses.dataclass(frozen=True, slots=True)
class DisconnectPeer(Action):
    """Forget a decode peer in the data plane: cancel its posts, release its dlists, remove its agent."""

    peer: str


@dataclasses.dataclass(frozen=True, slots=True)
class ForgetEndpoint(Action):
    """Close the control socket to a peer that went away (after what was queued for it left)."""

    endpoint: str


@dataclasses.dataclass(frozen=True, slots=True)
class FetchTopology(Action):
    """Look the prefill instance at ``addr`` up (``GET /route``); answer with ``topology_fetched``."""

    addr: str


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RoomReady(Action):
    """A sender left Bootstrapping (every destination known, or failed)."""

    room: SenderRoom


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ChunkPosted(Action):
    """Every write of chunk ``chunk`` of a sender was handed to the data plane (or dropped: the room failed)."""

    room: SenderRoom
    chunk: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class InitDone(Action):
    """A receiver left Resolving: its destination went out, or it failed."""

    room: ReceiverRoom


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Scatter(Action):
    """Copy a room's staged head slices from decode's staging slots into its pages; answer with
    ``scattered``. One ``StagedSlice`` per prefill rank that wrote into staging."""

    room: ReceiverRoom
    slices: tuple[StagedSlice, ...]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Finished(Action):
    """A room's outcome is decided (``room.poll()`` is Success or Failed)."""

    room: SenderRoom | ReceiverRoom


@dataclasses.dataclass(frozen=True, slots=True)
class PeerUp(Action):
    """First contact with a peer completed after ``seconds``."""

    peer: str
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class PeerDown(Action):
    """A peer was declared dead or said goodbye (``farewell``); its rooms were failed."""

    peer: str
    error: BaseException
    farewell: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Closed(Action):
    """``close()`` completed in the core: nothing in flight, every status and goodbye queued."""

    detail: Any = None
