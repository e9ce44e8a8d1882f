"""Posts queued together to one peer, moved as one NIXL handle by the engine thread.

When the loop hands over posts faster than the engine copies them (1,000 rooms in flight), the
engine's command queue holds hundreds. Each post used to cost its own ``make_prepped_xfer``,
``transfer`` and ``release_xfer_handle``, and the engine gives up and takes back the GIL around
each of those calls: with the loop busy on the same GIL, taking it back was most of the
engine's time (a traced run at 1,000 rooms in flight: a median of 950 posts waiting for the
engine, 13% of transfers taking over 1 ms of wall time for a 256 KiB copy of 62 us median).

So the engine moves a run of consecutive queued posts to the same peer in one handle when each is
one prepared piece under ``MERGE_MEMBER_MAX_BYTES`` (no explicit descriptors, no SGLang
notification, not a warm-up), none is refused (cancelled, lease lapsed, peer gone) when the run is
formed, and the run holds at least ``MERGE_MIN_POSTS`` and at most ``MERGE_MAX_POSTS`` posts, bytes
and descriptors (the bounds on one handle that the manager's config sets). A cancelled or refused
post never joins a run, so it never starts. The merged post carries the originals as ``members`` and
settles each: with the handle's outcome, or with a member's own first stop (a cancel that came while
the handle was in flight, as a single post's would: its bytes may have landed, it settles as
cancelled). A lane's share of a split write states its own pieces' descriptors (``lanes``), so
merged shares keep the bounds too. A handle parked past a deadline or at close marks every member as
settled with a handle in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .base import PreppedPiece, Write
from .commands import Command, PostCmd

__all__ = ["MERGE_MAX_BYTES", "MERGE_MAX_DESCS", "MERGE_MAX_POSTS", "MERGE_MEMBER_MAX_BYTES", "MERGE_MIN_POSTS",
           "merge_run", "members"]

MERGE_MIN_POSTS, MERGE_MAX_POSTS = 4, 64
"""Fewer posts queued together go one handle each: each settles as soon as it copied."""
MERGE_MAX_BYTES = 32 << 20
"""A merged handle moves at most this many bytes: the first member's settle waits for the whole
copy, about 8 ms at 4 GB/s. 1-page rooms of 64 buffers (2 MiB posts), 32 in flight, 8 interleaved
pairs: 956 -> 1,105 requests/s (medians) against 8 MiB, where four such posts never merged. A
manager lowers it to its ``Config.xfer_handle_bytes`` (the fence's bound on one handle)."""
MERGE_MEMBER_MAX_BYTES = 4 << 20
"""A post this large or larger never merges: it copies for a millisecond or more, next to which
its own handle's cost is small, and merged it would wait for its neighbours' copies to settle.
(Shares of a split write, 4 MiB and up, merged four to a handle on each lane made rooms started
together finish together, and one slow lane held all of them.)"""
MERGE_MAX_DESCS = 16384
"""Descriptors a merged handle may hold (a manager sets its ``Config.max_descs_per_xfer``)."""


def _mergeable(cmd: Command, peer: str) -> bool:
    if not isinstance(cmd, PostCmd) or cmd.peer != peer or cmd.fut is not None or not cmd.leased or cmd.members:
        return False
    write = cmd.write
    return len(write.pieces) == 1 and isinstance(write.pieces[0], PreppedPiece) and not write.notif \
        and cmd.next_piece == 0 and write.nbytes < MERGE_MEMBER_MAX_BYTES


def merge_run(commands: Sequence[Command], refusal: Callable[[PostCmd, float], BaseException | None], now: float,
              max_bytes: int = MERGE_MAX_BYTES, max_descs: int = MERGE_MAX_DESCS) -> PostCmd | None:
    """One post for the run of posts that starts ``commands`` (none with a ``refusal`` at ``now``), or
    None when fewer than ``MERGE_MIN_POSTS`` would merge within ``max_bytes`` and ``max_descs``. The
    run's posts are ``commands[:len(result.members)]``."""
    first = commands[0]
    if not isinstance(first, PostCmd) or not _mergeable(first, first.peer) or refusal(first, now) is not None:
        return None
    run, nbytes, descs = [first], first.write.nbytes, first.write.descriptors
    for cmd in commands[1:MERGE_MAX_POSTS]:
        if not isinstance(cmd, PostCmd) or not _mergeable(cmd, first.peer) or nbytes + cmd.write.nbytes > max_bytes \
                or descs + cmd.write.descriptors > max_descs or refusal(cmd, now) is not None:
            break
        run.append(cmd)
        nbytes, descs = nbytes + cmd.write.nbytes, descs + cmd.write.descriptors
    if len(run) < MERGE_MIN_POSTS:
        return None
    pieces = [p.write.pieces[0] for p in run]
    src = np.concatenate([p.src_idx for p in pieces if isinstance(p, PreppedPiece)])
    dst = np.concatenate([p.dst_idx for p in pieces if isinstance(p, PreppedPiece)])
    write = Write((PreppedPiece(src, dst),), descs, nbytes)
    return PostCmd(-2, first.peer, write, min(p.timeout_s for p in run), members=tuple(run))


def members(posts: Sequence[PostCmd]) -> list[PostCmd]:
    """The posts the loop handed over, a merged one's members in its place."""
    return [m for post in posts for m in (post.members or (post,))]
