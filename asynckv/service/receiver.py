"""KVReceiver: the decode side of one room."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    Aborted,
    AsyncKVError,
    InvalidArgument,
    LocalProtocolError,
    PeerUnreachable,
    TransferFailed,
    WaitingTimeout,
)
from ..kernels import validate_pages
from ..proto.messages import Abort, Status, TransferInfo
from ..proto.states import Event, KVPoll, RoomState, Side
from ..proto.topology import TargetPlan

if TYPE_CHECKING:
    from .manager import KVManager

__all__ = ["KVReceiver"]

log = logging.getLogger("asynckv.receiver")


class KVReceiver:
    """Receives one room's KV pages into pages decode pre-allocated.

    Lifecycle: ``await init(pages, aux_index)`` → ``await wait()`` → ``clear()``.
    ``async with mgr.receiver(addr, room) as r:`` aborts on exit if the room is unfinished.

    Fencing: a room that fails is reported Failed (by ``poll()`` and ``wait()``) only once
    every prefill sender that may have been writing into its pages has confirmed it writes
    no more, or has been declared dead; only then may decode reuse the pages.
    """

    def __init__(self, mgr: KVManager, bootstrap_addr: str, room: int) -> None:
        self._mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = room
        self._state = RoomState(Side.RECEIVER)
        self._loop = mgr.loop
        self._done: asyncio.Future[KVPoll] = self._loop.create_future()
        self._plan: TargetPlan | None = None
        self._responses: set[int] = set()
        self._sent_to: set[str] = set()
        """Prefill incarnations that got this room's destination (they may write into it)."""
        self._quiet: set[str] = set()
        """Prefill incarnations known to write no more (reported a status, or dead)."""
        self._failing: BaseException | None = None
        self._initialized = False
        self._cleared = False
        self._started: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- public --------------------------------------------------------------------

    def poll(self) -> KVPoll:
        """Current state, without blocking (Failed only once the room's pages are fenced)."""
        return self._state.state

    @property
    def failure_reason(self) -> str | None:
        return self._state.reason

    def failure_exception(self) -> BaseException | None:
        """The exception that failed the room, or None."""
        return self._state.exception

    async def init(self, page_indices: Any, aux_index: int = -1, state_indices: Any = None,
                   decode_prefix_len: int = 0) -> KVPoll:
        """Send the destination to the prefill rank(s) of this room.

        ``page_indices``: decode pages for the prompt after the first ``decode_prefix_len``
        tokens (which decode already holds; a multiple of page_size). ``aux_index``: the
        metadata row, -1 for none. ``state_indices``: the request's mamba slot, or its
        SWA/NSA state pages, for hybrid models. Invalid input raises ``InvalidArgument``; a
        prefill that cannot be reached or refuses us fails the room (the return value and
        ``wait()`` say Failed, with a reason).
        """
        if self._initialized:
            raise LocalProtocolError(f"room {self.room}: init() called twice")
        if self._state.done or self._failing is not None:
            return self._state.state
        a = self._mgr.kv_args
        pages = validate_pages(page_indices, a.num_pages, "decode page indices")
        if aux_index != -1 and not 0 <= aux_index < a.num_aux_rows:
            raise InvalidArgument(f"aux_index {aux_index} outside the registered aux rows [0, {a.num_aux_rows})")
        state = validate_pages([] if state_indices is None else state_indices, a.num_state_slots,
                               "decode state indices")
        if type(decode_prefix_len) is not int or decode_prefix_len < 0 or decode_prefix_len % a.page_size:
            raise InvalidArgument(f"decode_prefix_len must be a multiple of page_size {a.page_size}, "
                                  f"got {decode_prefix_len!r}")
        self._initialized = True
        self._started = self._loop.time()
        self._timer = self._loop.call_later(self._mgr.config.waiting_timeout_s, self._on_waiting_timeout)
        try:
            instance = await self._mgr.prefill_instance(self.bootstrap_addr)
            plan = self._mgr.target_plan(self.bootstrap_addr, instance, self.room)
            self._plan = plan
            for rank in plan.ranks:
                await self._mgr.ensure_registered(rank, self.bootstrap_addr)
            dst, dst_state, empty = pages.astype(np.int32), state.astype(np.int32), np.empty(0, dtype=np.int32)
            for target in plan.targets:
                if self._failing is not None:
                    break
                if not target.is_dummy:
                    self._sent_to.add(target.rank.agent_id)
                await self._mgr.send_control(target.rank.endpoint, TransferInfo(
                    self.room, self._mgr.name, target.rank.agent_id, int(aux_index), plan.required_dst_info_num,
                    target.is_dummy, target.write_aux, decode_prefix_len, empty if target.is_dummy else dst,
                    empty if target.is_dummy else dst_state))
        except AsyncKVError as exc:
            self._fail(exc)
            return self._state.state
        if self._failing is None:
            self._state.apply(Event.DESTINATION_SENT)
            self._maybe_complete()  # the status may have overtaken the end of init()
        return self._state.state

    async def wait(self, timeout: float | None = None) -> KVPoll:
        """Wait for the outcome: Success or Failed (never raises for a failed transfer).

        Failed is returned once the room's pages are fenced. Cancelling the waiting task
        does not abort the room; ``abort()`` does.
        """
        if timeout is None:
            return await asyncio.shield(self._done)
        return await asyncio.wait_for(asyncio.shield(self._done), timeout)

    async def abort(self, reason: str = "aborted by decode") -> KVPoll:
        """Fail the room, tell every prefill rank involved, and return once none of them can
        still write into its pages (confirmed, or declared dead after ``fence_timeout_s``)."""
        self._fail(Aborted(reason))
        return await asyncio.shield(self._done)

    def clear(self) -> None:
        """Drop every per-room structure. On an unfinished room this starts an abort but cannot
        wait for the fence: ``await abort()`` first if the pages are to be reused."""
        if self._cleared:
            return
        if not self._state.done:
            self._fail(Aborted("cleared before completion"))
        self._cleared = True
        self._cancel_timer()
        self._responses.clear()
        self._mgr._forget_receiver(self.room)

    async def __aenter__(self) -> KVReceiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._state.done:
            await self.abort("receiver context exited before completion")

    def __repr__(self) -> str:
        need = self._plan.required_responses if self._plan else "?"
        return (f"<KVReceiver room={self.room} {self._state.state.name} "
                f"{len(self._responses)}/{need} senders from {self.bootstrap_addr}>")

    # -- driven by the manager ----------------------------------------------------------

    def _on_status(self, msg: Status) -> None:
        if self._plan is None or msg.prefill_id not in {r.agent_id for r in self._plan.ranks}:
            self._mgr._drop("late_status", f"room {self.room} status from {msg.prefill_id[:8]}")
            return
        self._quiet.add(msg.prefill_id)  # a status, either way, means that rank writes no more
        if not msg.ok:
            self._fail(TransferFailed(f"prefill rank {msg.sender_rank}: {msg.reason}"))
        elif not self._state.done and self._failing is None:
            self._responses.add(msg.sender_rank)
            self._maybe_complete()
        self._maybe_fenced()

    def _on_peer_dead(self, prefill_id: str, exc: BaseException) -> None:
        if self._plan is None or prefill_id not in {r.agent_id for r in self._plan.ranks}:
            return
        self._quiet.add(prefill_id)
        if not self._state.done:
            self._fail(exc)
        self._maybe_fenced()

    def _maybe_complete(self) -> None:
        if (self._plan is not None and len(self._responses) >= self._plan.required_responses
                and self._state.state == KVPoll.WaitingForInput and self._failing is None):
            self._state.apply(Event.TRANSFER_COMPLETED)
            self._cancel_timer()
            self._resolve()

    def _on_waiting_timeout(self) -> None:
        self._timer = None
        self._fail(WaitingTimeout(f"room {self.room}: no result from prefill {self.bootstrap_addr} after "
                                  f"{self._mgr.config.waiting_timeout_s:.1f}s in {self._state.state.name}"))

    def _fail(self, exc: BaseException) -> None:
        """Start failing: tell the senders that may still write, then wait for the fence."""
        if self._state.done or self._failing is not None:
            return
        self._failing = exc
        log.info("room %d failing: %s", self.room, exc)
        self._cancel_timer()
        if self._plan is not None and not self._mgr._closed:
            # Every target hears of it, dummies and ranks that never got the destination too:
            # their senders (created by prefill's scheduler) fail now instead of at their timeout.
            msg = Abort(self.room, self._mgr.name, str(exc) or type(exc).__name__)
            for rank in self._plan.ranks:
                self._mgr.send_soon(rank.endpoint, msg)
            if self._sent_to - self._quiet:
                self._timer = self._loop.call_later(self._mgr.config.fence_timeout_s, self._on_fence_timeout)
        self._maybe_fenced()

    def _maybe_fenced(self) -> None:
        if self._failing is None or self._state.done:
            return
        if self._sent_to - self._quiet and not self._mgr._closed:
            return
        self._cancel_timer()
        self._state.fail(self._failing)
        self._resolve()

    def _resolve(self) -> None:
        if self._done.done():
            return
        seconds = None if self._started is None else self._loop.time() - self._started
        self._mgr.room_finished(self._state.state, self._state.exception, seconds, self.bootstrap_addr)
        self._done.set_result(self._state.state)

    def _on_fence_timeout(self) -> None:
        self._timer = None
        for prefill_id in sorted(self._sent_to - self._quiet):
            self._mgr.declare_dead(prefill_id, PeerUnreachable(
                f"prefill {prefill_id[:8]} did not confirm the abort of room {self.room} within "
                f"{self._mgr.config.fence_timeout_s:.1f}s"))
        self._quiet |= self._sent_to
        self._maybe_fenced()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
