"""PrefillCore: every rule of the prefill side, sans-IO.

Feed it events (``receive``, ``post_settled``, ``peer_connected``, ``handle_timer`` and the
sender API calls, each with ``now``) and run the actions it returns (``actions()``). It
owns the room table, the early table, the decode peers and their sessions, liveness and
write leases, and the in-flight byte budget. The rules live in four files: rooms, aborts and
failure notices here, destinations (their checks and the early table) in ``prefill_dest``,
peers in ``prefill_peers``, writes and the budget in ``prefill_writes``.

The fencing rules it keeps:

- a failed room posts nothing new; writes already handed to the data plane are cancelled,
  and decode hears ``Status(ok=False)`` only once every one of them has settled (DRAINING);
- a chunk waiting for the byte budget is never posted once its room failed;
- a dropped decode peer (dead, said goodbye, registered again) has its posts cancelled and
  hears ``Bye`` only once they all settled; a later registration starts a new session;
- ``close()`` fails every room, and says goodbye to each peer after its writes settled,
  after every status already decided (messages to one peer leave in order).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from ..config import Config
from ..errors import Aborted, BootstrapTimeout, ClosedError, InvalidArgument, LocalProtocolError, PeerUnreachable
from ..kernels import validate_pages
from ..layout import KVArgs
from .actions import CancelPosts, Closed, Finished, Send
from .core import check_int, check_new_room
from .early import EarlyRoom, EarlyTable
from .messages import Abort, Bye, Ping, Pong, Register, Status, TransferInfo
from .prefill_dest import DestinationRules, ended_reason
from .prefill_peers import PeerRules
from .prefill_writes import WriteRules
from .sender import DecodePeer, PeerPhase, SenderRoom
from .states import Event, SenderState
from .timers import earliest

__all__ = ["PrefillCore", "check_int"]

log = logging.getLogger("asynckv.prefill")


class PrefillCore(DestinationRules, PeerRules, WriteRules):
    """The prefill side of one rank (see the module docstring)."""

    mode = "prefill"

    def __init__(self, name: str, endpoint: str, kv_args: KVArgs, config: Config) -> None:
        super().__init__(name, endpoint, kv_args, config)
        a = kv_args
        self.sender_rank = (a.dp_rank * a.tp_size + a.engine_rank) * a.pp_size + a.pp_rank
        self._init_writes()
        self.rooms: dict[int, SenderRoom] = {}
        self.draining: dict[SenderRoom, None] = {}
        """Cleared rooms whose writes are still settling (decode is told when they have); ordered."""
        self.peers: dict[str, DecodePeer] = {}
        self.retired: dict[DecodePeer, None] = {}
        """Dropped peers whose posts or connection are still settling; ordered."""
        self._blocked: dict[str, DecodePeer] = {}
        """New sessions waiting until no older session of their decode is still connecting."""
        self.ended: collections.OrderedDict[str, DecodePeer] = collections.OrderedDict()
        """The last connected session of each decode that ended and has none connected since."""
        self.early = EarlyTable(config.max_early_infos, config.early_info_ttl_s, self.stats,
                                max_bytes=config.max_early_bytes, max_ranks=config.max_peers)
        self._init_destinations()
        self._handlers.update({
            Register: self._on_register, TransferInfo: self._on_transfer_info, Abort: self._on_abort,
            Ping: self._on_ping, Pong: self._on_pong, Bye: self._on_bye,
        })

    # -- the surface the pump drives ---------------------------------------------------

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must run next (monotonic seconds), or None."""
        when = earliest(self.deadlines.next(), self.early.next_deadline())
        return earliest(when, self._next_beat) if len(self.liveness) else when

    def handle_timer(self, now: float) -> None:
        for room in self.deadlines.pop_due(now):
            if room.state is SenderState.BOOTSTRAPPING:
                self.fail(room, BootstrapTimeout(
                    f"room {room.room}: no destination from decode after {self.config.bootstrap_timeout_s:.1f}s "
                    f"({len(room.destinations)}/{room.required or 1} decode ranks)"), now)
        self.early.expire(now)
        if self._beat_due(now):
            self._heartbeat(now)

    def close(self, now: float) -> None:
        """Fail every room and drop every peer; ``Closed`` follows once every write settled."""
        if self.closing:
            return
        self.closing = True
        for room in list(self.rooms.values()):
            self.fail(room, ClosedError("manager closed"), now)
            self.clear_sender(room, now)
        self._blocked.clear()
        self._drop_checks()
        self.early.clear()  # nobody will create a sender here any more
        for peer in list(self.peers.values()):
            self.drop_peer(peer, ClosedError("manager closed"), now, say_bye=True, farewell=True)
        self.ended.clear()  # (no sender opens any more: what those sessions still send is dropped)
        self._maybe_closed()

    # -- sender API --------------------------------------------------------------------

    def open_sender(self, room: int, now: float) -> SenderRoom:
        """A new sender for ``room``; destinations or aborts that came first apply at once."""
        check_new_room(room, self.rooms, self.config.max_rooms, self.closing)
        sender = self.rooms[room] = SenderRoom(room)
        self.deadlines.arm(sender, now + self.config.bootstrap_timeout_s)
        early = self.early.pop(room)
        if early is not None:
            self._keep_pending_notice(room, early, now)
            ended = None
            for decode_id, dest in early.infos.items():  # only from the session they came in, if it lives on
                if self.peers.get(decode_id) is dest.peer and dest.peer.phase is PeerPhase.CONNECTED:
                    self._on_destination(sender, dest.info, dest.peer, None, now)  # checked on arrival
                else:  # that session ended since: the decode failed this request with it and needs nothing more
                    self._answered(sender, decode_id, dest.epoch, dest.info.required_dst_info_num)
                    ended = ended or dest.peer
            for abort in early.aborts.values():  # that decode needs nothing more from this sender
                self._answered(sender, abort.decode_id, abort.epoch, abort.required)
            if early.aborts:
                self.fail(sender, Aborted(f"aborted by decode: {next(iter(early.aborts.values())).reason}"), now)
            elif ended is not None:  # (waiting for its bootstrap timeout, it then left a notice nobody would read)
                self.fail(sender, PeerUnreachable(ended_reason(room, ended, "this sender opened")), now)
        return sender

    def _keep_pending_notice(self, room: int, early: EarlyRoom, now: float) -> None:
        """A failure notice that still waits for decode ranks outlives the opening of a later sender of
        the room id: what those ranks send next is the old request's (``_owes_notice``), answered with
        its failure, and must not become this sender's destination (its pages are the old request's)."""
        if early.failed is None or (early.required is not None and len(early.answered) >= early.required):
            return
        rest = self.early.get_or_add(room, now)
        if rest is None or not self.early.leave_notice(rest, early.failed, early.answered, early.required):
            self._drop("early_notice", f"room {room}: failure notice not kept past a new sender (early bounds)")
            self.early.discard_if_empty(room)

    def sender_init(self, room: SenderRoom, num_pages: Any, aux_index: Any, now: float) -> None:
        """How many pages the room sends in total, and which aux row carries its metadata (-1: none)."""
        if room.num_pages is not None:
            raise LocalProtocolError(f"room {room.room}: init() called twice")
        pages = check_int(num_pages, "num_pages")
        aux = check_int(aux_index, "aux_index", low=-1)
        rows = self.num_aux_rows
        if aux != -1 and aux >= rows:
            raise InvalidArgument(f"aux_index {aux} outside the registered aux rows [0, {rows})")
        room.num_pages, room.aux_index = pages, aux
        if room.state is SenderState.READY:
            self._check_page_counts(room, now)

    def send_chunk(self, room: SenderRoom, page_indices: Any, state_indices: Any, now: float) -> int | None:
        """Queue one chunk; returns its number (``ChunkPosted`` follows), or None if the room already failed."""
        if room.state in (SenderState.DRAINING, SenderState.FAILED):
            return None
        if room.num_pages is None:
            raise LocalProtocolError(f"room {room.room}: send() before init()")
        if room.state not in (SenderState.READY, SenderState.TRANSFERRING):
            raise LocalProtocolError(f"room {room.room}: send() in state {room.poll().name}")
        if room.last_queued:
            raise LocalProtocolError(f"room {room.room}: the last chunk was already sent")
        pages = validate_pages(page_indices, self.num_pages, "prefill page indices")
        n = len(pages)
        if room.cursor + n > room.num_pages:
            raise InvalidArgument(f"room {room.room}: chunk of {n} pages overruns num_pages={room.num_pages} "
                                  f"(already sent {room.cursor})")
        is_last = room.cursor + n == room.num_pages
        state = None
        if state_indices is not None:
            if not is_last:
                raise InvalidArgument(f"room {room.room}: state_indices go with the last chunk")
            state = validate_pages(state_indices, self.kv_args.num_state_slots, "prefill state indices")
        start, room.cursor, room.last_queued = room.cursor, room.cursor + n, is_last
        if room.started is None:
            room.started = now
        chunk = room.chunks
        room.chunks += 1
        room.move(Event.CHUNK_QUEUED)
        try:
            writes = self._chunk_writes(room, pages, start, state if is_last else None, is_last)
        except InvalidArgument as exc:
            self.fail(room, exc, now)
            return chunk
        self._queue_writes(room, chunk, writes)
        self._maybe_succeed(room, now)
        return chunk

    def abort_sender(self, room: SenderRoom, exc: BaseException, now: float) -> None:
        self.fail(room, exc, now)

    def clear_sender(self, room: SenderRoom, now: float) -> None:
        """Forget the room; an unfinished one is aborted first (decode is told once its writes settled)."""
        if room.cleared:
            return
        if room.active:
            self.fail(room, Aborted("cleared before completion"), now)
        room.cleared = True
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]
        self.deadlines.arm(room, None)
        if room.state is SenderState.DRAINING:
            self.draining[room] = None
        else:
            self._retire(room, now)

    # -- messages -------------------------------------------------------------------------

    def _on_abort(self, msg: Abort, now: float) -> None:
        """Fail the room; decode learns that nothing more will be written from a Status, sent once the
        writes into that destination settled (at once when none can be in flight)."""
        peer = self.peers.get(msg.decode_id)
        reason = f"aborted by decode: {msg.reason}"

        def ack() -> None:
            if peer is not None and peer.phase is PeerPhase.CONNECTED:
                self._status(peer, msg.room, msg.epoch, False, reason)

        current = self.rooms.get(msg.room)
        for room in [*([current] if current is not None else []), *self.draining]:
            dest = room.destinations.get(msg.decode_id)
            if room.room != msg.room or dest is None or dest.epoch != msg.epoch:
                continue
            if room.active:
                self.fail(room, Aborted(reason), now)  # tells that decode now, or once its writes settled
            elif room.state is not SenderState.DRAINING:
                ack()
            return  # (a draining room tells that decode once its writes settled)
        early = self.early.get(msg.room)
        parked = None if early is None else early.infos.get(msg.decode_id)
        if early is not None and parked is not None and parked.epoch == msg.epoch:
            self.early.unpark(early, msg.decode_id)  # its destination waited for a sender: never used now
            if not self.early.keep_abort(early, msg):
                self._drop("early_abort", f"room {msg.room}: abort of {msg.decode_id[:8]} not kept (early bounds)")
                self.early.discard_if_empty(msg.room)
        elif self._owes_notice(early, current, msg.decode_id, msg.epoch) is not None:  # the notice's request
            self._notice_answered(msg.room, msg.decode_id, msg.epoch, msg.required, now)
        elif current is not None and not self._later_request(current, msg.decode_id, msg.epoch):
            if msg.decode_id not in current.destinations:  # the abort came before that decode's destination
                if not msg.destination_sent:
                    self.fail(current, Aborted(reason), now)
                self._answered(current, msg.decode_id, msg.epoch, msg.required)
        elif not msg.destination_sent:  # a sender created later fails at once instead of at its timeout
            early = self.early.get_or_add(msg.room, now)
            if early is not None and not self.early.keep_abort(early, msg):
                self._drop("early_abort", f"room {msg.room}: abort of {msg.decode_id[:8]} not kept (early bounds)")
                self.early.discard_if_empty(msg.room)
        ack()

    # -- rooms ----------------------------------------------------------------------------

    def fail(self, room: SenderRoom, error: BaseException, now: float) -> None:
        """Fail the room: nothing more is posted, writes in flight are cancelled, and decode is told once
        they have all settled (landed, failed or cancelled), so it may reuse its pages."""
        if not room.active:
            return
        room.exception, room.finished = error, now
        self.deadlines.arm(room, None)
        log.info("room %d failed: %s", room.room, room.reason)
        if room.posts:
            room.move(Event.FAILED_WRITES_IN_FLIGHT)
            self._emit(CancelPosts(tuple(sorted(room.posts)), error))
        else:
            room.move(Event.FAILED)
            self._report_failure(room, now)
        self._emit(Finished(room))

    def _maybe_succeed(self, room: SenderRoom, now: float) -> None:
        if room.state is not SenderState.TRANSFERRING or not room.last_queued or room.queued or room.posts:
            return
        room.move(Event.WRITES_LANDED)
        room.finished = now
        for dest in room.destinations.values():  # dummies report failures only: decode counts real senders
            if not dest.info.is_dummy or len(dest.info.dst_state_indices):  # (and dummies writing their state)
                self._status(dest.peer, room.room, dest.epoch, True, "")
        self._emit(Finished(room))

    def _report_failure(self, room: SenderRoom, now: float) -> None:
        """Nothing of the room is in flight: tell every destination still registered (dummies too)."""
        reason = room.reason or "failed"
        for dest in room.destinations.values():
            self._status(dest.peer, room.room, dest.epoch, False, reason)
        if room.cleared:
            self.draining.pop(room, None)
            self._retire(room, now)

    def _answered(self, room: SenderRoom, decode_id: str, epoch: int, required: int) -> None:
        """``decode_id`` is not a destination of ``room`` but needs nothing more from it (kept for at most
        as many decode ranks as there can be peers: aborts come from anyone)."""
        if decode_id in room.answered or len(room.answered) < self.config.max_peers:
            room.answered[decode_id] = epoch
        if room.required is None:
            room.required = required

    def _notice_answered(self, room: int, decode_id: str, epoch: int, required: int, now: float) -> None:
        """A decode rank learnt of the failure notice of ``room`` (or aborted): the notice goes once
        every decode rank of the room did."""
        early = self.early.get(room)
        if early is None:
            return
        if not self.early.mark_answered(early, decode_id, epoch):  # a rank told but not recorded would
            self._drop("early_notice", f"room {room}: notice dropped, answered ranks not kept (early bounds)")
            self.early.drop_notice(room, now)  # take its next request for the old one's: no notice
            return
        early.required = early.required or required
        if len(early.answered) >= early.required:
            self.early.drop_notice(room, now)  # (what else waits there is for a later request reusing the id)

    def _retire(self, room: SenderRoom, now: float) -> None:
        """A cleared room with nothing in flight; leave a failure notice for destinations still to come."""
        if room.exception is None or room.room in self.rooms:
            return
        answered = {**room.answered, **{d: dest.epoch for d, dest in room.destinations.items()}}
        if room.required is not None and len(answered) >= room.required:
            return  # every decode rank of the room was told or needs nothing: no notice to leave
        early = self.early.get_or_add(room.room, now)
        if early is not None and not self.early.leave_notice(early, room.reason or "failed", answered, room.required):
            self._drop("early_notice", f"room {room.room}: failure notice not kept (max_early_bytes)")
            self.early.discard_if_empty(room.room)

    def _check_page_counts(self, room: SenderRoom, now: float) -> None:
        for dest in room.destinations.values():
            if not dest.info.is_dummy and len(dest.info.dst_pages) != room.num_pages:
                self.fail(room, InvalidArgument(f"room {room.room}: decode expects {len(dest.info.dst_pages)} "
                                                f"pages, prefill will send {room.num_pages}"), now)
                return

    # -- helpers -------------------------------------------------------------------------

    def _status(self, peer: DecodePeer, room: int, epoch: int, ok: bool, reason: str) -> None:
        if peer.phase is PeerPhase.CONNECTED and self.peers.get(peer.name) is peer:
            self._emit(Send(peer.endpoint, Status(room, epoch, self.name, peer.session, self.sender_rank, ok, reason)))

    def _maybe_closed(self) -> None:
        if self.closing and not self.closed and not self.posts and not self.retired:
            self.closed = True
            self._emit(Closed())

    # -- introspection -----------------------------------------------------------------------

    def room_counts(self) -> dict[str, int]:
        """Per-room table sizes; all zero once every room was cleared and settled."""
        return {"senders": len(self.rooms), "draining_rooms": len(self.draining), "early_rooms": len(self.early),
                "early_bytes": self.early.nbytes + self.early.pending, "destination_checks": self.destination_checks(),
                "queued_writes": len(self._queue), "posts": len(self.posts), "inflight_bytes": self.inflight_bytes}

    def snapshot(self, now: float) -> dict[str, Any]:
        """Rooms by state and peers with their unfinished rooms: plain JSON types only."""
        by_state = collections.Counter(room.poll().name for room in self.rooms.values())
        per_peer: collections.Counter[str] = collections.Counter()
        for room in self.rooms.values():
            if room.active:
                per_peer.update(d.peer.name for d in room.destinations.values())
        peers = []
        for peer in self.peers.values():
            state = self.liveness.get(peer.name)
            heard = None if state is None else now - state.last_seen
            peers.append({"peer": peer.name, "endpoint": peer.endpoint, "session": peer.session,
                          "phase": peer.phase.value, "last_heard_s_ago": heard,
                          "alive": heard is not None and heard <= 2 * self.config.heartbeat_interval_s,
                          "rooms": per_peer[peer.name]})
        return {"mode": "prefill", "name": self.name, "rooms": dict(by_state), "peers": peers,
                "tables": self.room_counts()}
