"""The commands the event loop hands the NIXL engine thread, and NIXL's errors in asynckv's tree."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import AsyncKVError, PeerUnreachable, TransportError
from .base import Write

__all__ = ["Call", "Cancel", "Command", "Forget", "PostCmd", "map_nixl_error"]


def map_nixl_error(exc: BaseException, what: str) -> BaseException:
    """Translate a nixl binding exception into asynckv's tree (keeps ours as they are)."""
    if isinstance(exc, AsyncKVError):
        return exc
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        err: BaseException = PeerUnreachable(f"{what}: peer disconnected ({name})")
    else:
        err = TransportError(f"{what}: {name}: {exc}")
    err.__cause__ = exc
    return err


@dataclasses.dataclass(slots=True, eq=False)
class PostCmd:
    post_id: int
    peer: str
    write: Write
    timeout_s: float
    leased: bool = True
    """Checked against the peer's write lease (the warm-up write into scratch is not)."""
    fut: asyncio.Future[None] | None = None
    """Set for internal posts the loop awaits (warm-up); others report through on_settled."""
    handle: Any = None
    """The handle in flight (NIXL cannot stop it: the post settles when it finishes)."""
    next_piece: int = 0
    """Index in ``write.pieces`` of the next handle to start."""
    deadline: float = 0.0
    stop: BaseException | None = None
    """Why the post may start nothing more and will settle with an error (cancel, lease, peer, failure)."""


@dataclasses.dataclass(slots=True)
class Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    fut: asyncio.Future[Any]


@dataclasses.dataclass(slots=True)
class Cancel:
    post_ids: tuple[int, ...]
    reason: BaseException


@dataclasses.dataclass(slots=True)
class Forget:
    peer: str


Command = Call | PostCmd | Cancel | Forget | None
