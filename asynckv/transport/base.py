"""What the service layer needs from a data plane and a control channel.

``asynckv.transport.nixl`` (NIXL) and ``asynckv.transport.control`` (ZMQ) implement these;
``asynckv.testing`` has a fake data plane and a fault-injecting wrapper. The service layer
imports neither nixl nor zmq: it talks to these protocols only.

The data plane's contract, which the cores' fencing relies on:

- every ``post`` settles exactly once, reported through ``on_settled``: all of it landed
  (error None), or none of it can land any more (failed, cancelled, lease lapsed, peer
  forgotten, plane closed), except a post past its deadline (or at close): it settles with a
  handle still in flight, which may still read the post's source memory and land bytes (see
  ``nixl_engine``); ``take_in_flight(post_id)`` answers True for it, once;
- a write is done as a series of handles (``Write.pieces``); the lease and the cancel set
  are checked before each handle, so once a post is cancelled or its lease has lapsed at
  most the one handle already copying can still land (one per write lane when a prefill
  spreads a large write's handles over its lanes: ``transport.lanes``);
- ``forget_peer`` cancels the peer's posts, releases what was prepared for it and removes
  its agent, in that order, before any later ``connect_peer`` of the same name;
- ``close`` does the same for every peer, then deregisters memory.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..proto.messages import Message
from ..proto.sglang import SglangMessage

__all__ = ["ControlPlane", "DataPlane", "DescPiece", "MemoryLayout", "Notified", "PreppedPiece", "Settled", "Write"]

U64 = npt.NDArray[np.uint64]

Settled = Callable[[list[tuple[int, BaseException | None]]], None]
"""Called on the event loop with (post_id, error) of posts that settled, in batches."""
Notified = Callable[[list[tuple[str, bytes]]], None]
"""Called on the event loop with (sending agent, message) of NIXL notifications, in batches."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryLayout:
    """What a rank registers, and its prepared local dlist (one row per (entry, page))."""

    regions: tuple[tuple[str, U64], ...]
    """(memory kind, Nx3 (addr, len, dev)) per registration."""
    local_rows: U64 | None = None
    local_kind: str = "DRAM"
    scratch: tuple[int, int] = (0, 0)
    """(addr, len) of a small DRAM region peers may write during the first-contact warm-up."""
    keep: tuple[object, ...] = ()
    """Buffers registered here on the plane's behalf (the staging area): a plane that closes with
    handles still in flight keeps them, with its agent, until the process exits."""


@dataclasses.dataclass(frozen=True, slots=True)
class PreppedPiece:
    """One handle over prepared dlists: local rows ``src_idx`` to the peer's rows ``dst_idx``."""

    src_idx: npt.NDArray[np.int32]
    dst_idx: npt.NDArray[np.int32]


@dataclasses.dataclass(frozen=True, slots=True)
class DescPiece:
    """One handle over explicit descriptors (Nx3 addr, len, dev)."""

    src: U64
    dst: U64
    src_kind: str
    dst_kind: str


@dataclasses.dataclass(frozen=True, slots=True)
class Write:
    """One post: its handles, each bounded in descriptors and bytes."""

    pieces: tuple[PreppedPiece | DescPiece, ...]
    descriptors: int
    nbytes: int
    notif: bytes = b""
    """A NIXL notification sent once every handle of the write completed (SGLang's wire completes
    rooms with them): never for a write that stopped (cancelled, lease, deadline), even when its
    last handle still lands. (Attached to a handle, NIXL would send it with that handle whatever
    happened to the write meanwhile.)"""


class DataPlane(Protocol):
    """Moves bytes into peers' registered memory (see the module docstring for the contract)."""

    on_settled: Settled

    @property
    def alive(self) -> bool: ...

    @property
    def posts_in_flight(self) -> int: ...

    async def start(self, memory: MemoryLayout) -> bytes:
        """Register memory; returns this side's metadata for peers."""
        ...

    async def connect_peer(self, peer: str, metadata: bytes, rows: U64 | None, mem_kind: str) -> None:
        """Import a peer (its metadata must name ``peer``) and prepare its destination rows."""
        ...

    async def warm_up(self, peer: str, dst: tuple[int, int], timeout_s: float) -> None:
        """A tiny write from our scratch area into the peer's ``(addr, len)``: absorbs connection set-up."""
        ...

    def post(self, post_id: int, peer: str, write: Write, timeout_s: float) -> None: ...

    def cancel(self, post_ids: Sequence[int], reason: BaseException) -> None: ...

    def take_in_flight(self, post_id: int) -> bool:
        """Whether settled post ``post_id`` left a handle in flight (asked once, when it settles)."""
        ...

    def set_lease(self, peer: str, until: float) -> None:
        """Posts to ``peer`` may start handles until ``until`` (monotonic seconds)."""
        ...

    def forget_peer(self, peer: str) -> None: ...

    async def close(self) -> None: ...


class ControlPlane(Protocol):
    """Control messages between ranks; messages to one endpoint leave in order."""

    endpoint: str
    received: int
    dropped: collections.Counter[str]

    @property
    def reader_alive(self) -> bool: ...

    async def start(self) -> str: ...

    def send(self, endpoint: str, msg: Message | SglangMessage, transient: bool = False) -> None: ...

    def forget(self, endpoint: str) -> None: ...

    async def close(self) -> None: ...
