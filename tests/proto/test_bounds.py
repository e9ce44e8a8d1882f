"""Prefill's tables and allocations are bounded before any work is done on a peer's claim.

Each test replays a claim that once cost memory or a stalled loop on the real ``PrefillCore``
(fed directly, simulated time), or on the simulator. The helpers use no API newer than the
protocol itself, so the same tests run against older code to show what they catch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, cast

import numpy as np
import pytest

from asynckv.config import Config
from asynckv.errors import Aborted, PeerUnreachable, RemoteProtocolError
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.early import EarlyRoom
from asynckv.proto.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    Abort,
    Message,
    Ping,
    Pong,
    Register,
    RegisterResult,
    Status,
    TransferInfo,
    decode,
    encode,
)
from asynckv.proto.prefill import PrefillCore
from asynckv.proto.sglang import SglangMessage
from asynckv.proto.states import ReceiverState, SenderState

from .harness import DEFAULTS, Cluster, register_pair

ITEM = 16
PREFILL = "prefill-agent"


def kv_args(pages: int, base: int = 0x10000000) -> KVArgs:
    """One layer (K and V) of ``pages`` pages of 16 bytes, fake addresses (nothing is dereferenced)."""
    return KVArgs(kv_data_ptrs=[base, base + 2**40], kv_data_lens=[pages * ITEM] * 2, kv_item_lens=[ITEM] * 2,
                  aux_data_ptrs=[base + 2**41], aux_data_lens=[8 * 16], aux_item_lens=[16], page_size=1)


def metadata(name: str) -> bytes:
    """NIXL agent metadata that names ``name`` and nothing else."""
    raw = name.encode()
    return b"nixlSerDes|Agent" + len(raw).to_bytes(8, "little") + raw + b"|stub"


def register(name: str, pages: int, *, tp: int = 1, session: int = 1) -> Register:
    d = kv_args(pages, base=0x7000000000)
    return Register(
        decode_id=name, prefill_id=PREFILL, session=session, lease_ms=3000, endpoint=f"tcp://127.0.0.1:{5000}",
        engine_rank=0, tp_size=tp, page_size=1, kv_dtype=d.kv_dtype, mem_kind="DRAM", is_mla=False, gpu_id=0,
        kv_ptrs=tuple(d.kv_data_ptrs), kv_lens=tuple(d.kv_data_lens), kv_item_lens=tuple(d.kv_item_lens),
        kv_layer_ids=d.layer_ids, aux_ptrs=tuple(d.aux_data_ptrs), aux_lens=tuple(d.aux_data_lens),
        aux_item_lens=tuple(d.aux_item_lens), scratch_ptr=0x1000, scratch_len=4096, kv_head_num=1,
        total_kv_head_num=1, state_type="none", state_ptrs=(), state_lens=(), state_item_lens=(),
        state_layer_ids=(), state_dims=(), state_outer=(), agent_metadata=metadata(name))


def info(room: int, name: str, pages: Any, *, epoch: int = 1, required: int = 1) -> TransferInfo:
    return TransferInfo(room, epoch, name, PREFILL, -1, required, False, True, 0, np.asarray(pages, dtype=np.int32),
                        np.empty(0, dtype=np.int32))


class Rank:
    """A ``PrefillCore`` fed directly: connections succeed at once; off-loop checks wait for ``answer()``."""

    def __init__(self, config: Config = DEFAULTS, pages: int = 64) -> None:
        self.core = PrefillCore(PREFILL, "tcp://127.0.0.1:1", kv_args(pages), config)
        self.now = 0.0
        self.sent: list[Message | SglangMessage] = []
        self.checks: list[Any] = []
        self.connects = 0

    def run(self) -> None:
        actions = self.core.actions()
        while actions:
            for a in actions:
                if isinstance(a, act.Send):
                    self.sent.append(a.msg)
                elif isinstance(a, act.ConnectPeer):
                    self.connects += 1
                    self.core.peer_connected(a.peer, None, self.now)
                elif type(a).__name__ == "CheckDestination":
                    self.checks.append(a)
            actions = self.core.actions()

    def feed(self, msg: Message) -> None:
        self.core.receive(msg, self.now)
        self.run()

    def answer(self) -> None:
        """Answer the off-loop checks asked for so far, in order (what the pump does on a worker thread)."""
        while self.checks:
            a = self.checks.pop(0)
            self.core.destination_checked(a.token, a.run(), self.now)
            self.run()

    def register(self, name: str, pages: int = 64, tp: int = 1) -> RegisterResult:
        self.feed(register(name, pages, tp=tp))
        result = self.sent[-1]
        assert isinstance(result, RegisterResult)
        return result

    def statuses(self, room: int | None = None) -> list[Status]:
        return [m for m in self.sent if isinstance(m, Status) and (room is None or m.room == room)]

    def parked(self) -> int:
        """Destinations waiting in the early table."""
        return sum(len(cast(EarlyRoom, self.core.early.get(room)).infos) for room in list(self.core.early._rooms))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- item 2: the early table --------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_one_room_parks_no_more_destinations_than_its_decode_ranks_and_refuses_the_rest_at_once() -> None:
    """48 registered decode peers each park an 8 MB destination for one room (max_early_infos=4 bounded
    rooms, not bytes): all 48 were kept for 600 s (+384 MB). Now the room keeps its one decode rank's
    destination, and the others hear Status(ok=False) naming the limit at once."""
    rank = Rank(dataclasses.replace(DEFAULTS, max_early_infos=4), pages=2**21)
    names = [f"decode-{i:02d}" for i in range(48)]
    for name in names:
        assert rank.register(name, pages=2**21).ok  # 2M pages each: an 8 MB destination is in range
    before = rss()
    for name in names:
        pages = np.arange(2**21, dtype=np.int32)  # 8 MB, valid, a new array each time
        rank.feed(info(7, name, pages))
        del pages
        rank.answer()
    grown = rss() - before
    print(f"RSS after 48 x 8 MB destinations for one room: {grown / 2**20:+.1f} MiB")
    assert rank.parked() == 1
    refused = rank.statuses(7)
    assert len(refused) == 47 and not any(s.ok for s in refused)
    assert all("required_dst_info_num=1" in s.reason for s in refused), refused[0].reason
    assert rank.core.stats["dropped_early_room_full"] == 47
    assert grown < 64 * 2**20


def test_the_early_table_is_bounded_by_bytes_and_refuses_beyond_at_once() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, max_early_bytes=2**20), pages=2**20)
    assert rank.register("decode", pages=2**20).ok
    for room in range(8):  # 256 KiB each: the fourth one does not fit in 1 MiB
        rank.feed(info(room, "decode", np.arange(room * 2**16, (room + 1) * 2**16)))
        rank.answer()
    assert rank.parked() == 3 and rank.core.room_counts()["early_bytes"] <= 2**20
    refused = rank.statuses()
    assert [s.room for s in refused] == [3, 4, 5, 6, 7] and not any(s.ok for s in refused)
    assert "max_early_bytes" in refused[0].reason and rank.core.stats["dropped_early_bytes"] == 5
    sender = rank.core.open_sender(0, rank.now)  # a parked destination still reaches its sender
    assert sender.state is SenderState.READY
    assert rank.core.room_counts()["early_bytes"] < 2**20 - 2**18


def test_an_invalid_destination_without_a_sender_is_answered_at_once_and_not_kept() -> None:
    """It waited (for the sender, or 600 s) and only then failed its room."""
    rank = Rank()
    assert rank.register("decode").ok  # 64 pages
    rank.feed(info(5, "decode", [1, 2, 64]))  # page 64 is out of range
    rank.feed(info(6, "decode", [3, 3]))  # repeated
    rank.feed(info(8, "decode", [4], required=2))  # a tp 1 decode is the only decode rank of a room
    assert [(s.room, s.ok) for s in rank.statuses()] == [(5, False), (6, False), (8, False)]
    reasons = [s.reason for s in rank.statuses()]
    assert "outside the registered range" in reasons[0] and "more than once" in reasons[1]
    assert "required_dst_info_num 2" in reasons[2]
    assert rank.core.room_counts()["early_rooms"] == 0 and rank.core.stats["dropped_early_invalid"] == 3


def test_a_destination_longer_than_the_registered_pool_is_refused_before_anything_is_sorted() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, offload_min_descs=1))  # every index check would go off the loop
    assert rank.register("decode").ok
    rank.feed(info(5, "decode", np.zeros(2**20, dtype=np.int32)))  # 4 MB against a pool of 64 pages
    assert rank.checks == []  # refused by its length alone, at once
    [status] = rank.statuses(5)
    assert not status.ok and "more than the 64 pages decode registered" in status.reason


def test_aborts_and_answers_from_unknown_decodes_are_bounded_per_room() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, max_peers=8))
    sender = rank.core.open_sender(3, rank.now)
    for i in range(100):  # anyone can claim to be a decode that aborted before its destination
        rank.feed(Abort(3, 1, f"nobody-{i}", True, 1000, "x" * 100))
    assert len(sender.answered) == 8
    for i in range(100):
        rank.feed(Abort(4, 1, f"nobody-{i}", False, 1000, "x" * 100))
    early = rank.core.early.get(4)
    assert early is not None and len(early.aborts) == 8


# -- item 3: registrations ------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [0, 3])
def test_a_register_claiming_tp_0_or_a_tp_not_dividing_ours_is_refused(tp: int) -> None:
    """TP 0 raised ZeroDivisionError out of the core (the rank-mapping check divides by it)."""
    rank = Rank()
    rank.core.kv_args = dataclasses.replace(rank.core.kv_args, tp_size=2)
    result = rank.register("odd", tp=tp)
    assert not result.ok and f"decode has {tp}" in result.reason
    assert rank.connects == 0 and rank.core.peers == {}


def test_a_register_claiming_10m_pages_is_refused_before_any_row_is_built() -> None:
    """A ~1 KB Register claiming 10M pages had its 20M destination rows built (+0.70 GB peak)."""
    rank = Rank()
    result = rank.register("greedy", pages=10_000_000)
    assert not result.ok and "max_peer_dlist_rows" in result.reason and "20000000 destination rows" in result.reason
    assert rank.connects == 0 and rank.core.peers == {}


def test_a_decode_pool_is_bounded_by_our_own_scaled_by_its_tp_or_by_the_configured_rows() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, max_peer_dlist_rows=16), pages=64)  # own pool: 2 x 64 rows
    assert rank.register("four-times", pages=256).ok
    result = rank.register("larger", pages=257)
    assert not result.ok and "at most 512 accepted" in result.reason
    assert rank.register("tp2", pages=512, tp=2).ok  # half the heads per page: twice the pages in the same memory
    rank = Rank(dataclasses.replace(DEFAULTS, max_peer_dlist_rows=10_000), pages=64)
    assert rank.register("configured", pages=5000).ok and not rank.register("beyond", pages=5001).ok


# -- item 5: message caps and off-loop checks, in order ---------------------------------------------


def frames_of(msg: Message) -> list[bytes]:
    return encode(msg)


@pytest.mark.parametrize("name, frames", [
    ("ping body", [struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, Ping.TYPE), json.dumps(
        {"sender_id": "d", "endpoint": "tcp://a:1", "session": 1, "seq": 1, "pad": "x" * 2000}).encode()]),
    ("pong body", [struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, Pong.TYPE), b" " * 5000]),
    ("status body", [struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, Status.TYPE), b" " * (65 * 1024)]),
    ("transfer info body", [struct.pack("<4sHH", MAGIC, PROTOCOL_VERSION, TransferInfo.TYPE), b" " * 8192,
                            b"", b""]),
    ("register metadata", [*encode(register("d", 4))[:2], b"m" * (16 * 2**20 + 1)]),
])
def test_each_message_type_has_a_size_cap_checked_before_its_body_is_parsed(name: str, frames: list[bytes]) -> None:
    with pytest.raises(RemoteProtocolError, match="exceeds its cap"):
        decode(frames)


def test_every_message_type_has_its_caps_and_identifiers_and_reasons_are_bounded() -> None:
    from asynckv.proto.messages import MESSAGE_TYPES
    from asynckv.proto.wire_limits import MAX_BODY_BYTES

    assert set(MAX_BODY_BYTES) == set(MESSAGE_TYPES)
    with pytest.raises(RemoteProtocolError, match="at most 128 characters"):
        decode(encode(Abort(1, 1, "d" * 129, False, 1, "why")))
    long = decode(encode(Abort(1, 1, "d", False, 1, "why " * 10_000)))
    assert isinstance(long, Abort) and len(long.reason) == 4096 and long.reason.endswith("...")
    big = info(1, "d", np.arange(2**24))  # a 64 MiB page array is accepted by the codec
    assert decode(encode(big)) == big


def test_a_large_destination_is_checked_off_the_loop_and_later_messages_of_its_peer_wait_in_order() -> None:
    """A TransferInfo followed by an Abort must be acted on in that order, whatever runs off the loop."""
    rank = Rank(dataclasses.replace(DEFAULTS, offload_min_descs=4))
    assert rank.register("decode").ok and rank.register("other").ok
    rank.feed(info(9, "decode", [1, 2, 3, 4, 5]))  # five indices: checked on a worker thread
    assert len(rank.checks) == 1 and rank.core.room_counts()["destination_checks"] == 1
    rank.feed(Abort(9, 1, "decode", True, 1, "client went away"))  # waits behind the check
    rank.feed(Ping("decode", "tcp://127.0.0.1:5000", 1, 1))
    rank.feed(Ping("other", "tcp://127.0.0.1:5000", 1, 1))  # another peer is not held up
    assert [type(m).__name__ for m in rank.sent[2:]] == ["Pong"]
    rank.answer()
    assert [type(m).__name__ for m in rank.sent[3:]] == ["Status", "Pong"]  # the abort's answer, then the pong
    assert rank.core.room_counts()["destination_checks"] == 0
    sender = rank.core.open_sender(9, rank.now)  # the abort came after the destination: the sender fails
    assert sender.reason is not None
    assert sender.state is SenderState.FAILED and "client went away" in sender.reason
    assert rank.core.room_counts()["early_bytes"] == 0


def test_a_check_that_finds_a_bad_index_fails_the_room_and_the_next_check_keeps_the_order() -> None:
    rank = Rank(dataclasses.replace(DEFAULTS, offload_min_descs=4))
    assert rank.register("decode").ok
    sender = rank.core.open_sender(1, rank.now)
    rank.feed(info(1, "decode", [1, 2, 3, 3]))  # repeated: found off the loop
    rank.feed(info(2, "decode", [5, 6, 7, 8]))  # held, then checked off the loop in its turn
    rank.feed(Abort(2, 1, "decode", True, 1, "gone"))
    assert len(rank.checks) == 1
    rank.answer()
    assert sender.reason is not None
    assert sender.state is SenderState.FAILED and "appears more than once" in sender.reason
    assert rank.core.early.get(2) is not None and "decode" in rank.core.early.get(2).aborts  # type: ignore[union-attr]


def answer_checks_after(c: Cluster, ms: float) -> None:
    """The simulator's pump for ``CheckDestination``: the answer comes ``ms`` later."""
    inner = c.w.on_action

    def on_action(node: Any, a: act.Action) -> None:
        inner(node, a)
        if type(a).__name__ == "CheckDestination":
            c.w.on(node, c.w.now + ms / 1000, c.w.drive, node, "destination_checked", a.token, a.run())  # type: ignore[attr-defined]

    c.w.on_action = on_action


def test_an_abort_right_after_its_destination_is_not_overtaken_by_the_check() -> None:
    c = Cluster(dataclasses.replace(DEFAULTS, offload_min_descs=1))  # every destination is checked off the loop
    answer_checks_after(c, 5)
    register_pair(c)
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 9)
    r = c.receiver(d, 9, [1, 2])  # the destination reaches prefill at 41 ms, its check ends at 46 ms
    c.w.drive(d, "abort_receiver", r, Aborted("client went away"))  # reaches prefill at 41 ms too
    c.run_ms(100)
    assert s.reason is not None
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 46.0 and "client went away" in s.reason
    assert r.state is ReceiverState.FAILED
    ok = c.receiver(d, 10, [3])
    s2 = c.sender(p, 10)
    c.run_ms(200)
    c.send(p, s2, [7])
    c.run_ms(300)
    assert ok.state is ReceiverState.SUCCEEDED
    c.check()


def test_a_destination_whose_session_ends_during_its_off_loop_check_fails_its_sender_at_once() -> None:
    """It was dropped as from an unknown peer: the sender waited for its bootstrap timeout (300 s)."""
    c = Cluster(dataclasses.replace(DEFAULTS, offload_min_descs=1))
    answer_checks_after(c, 5)
    register_pair(c)
    p, d = c.p[0], c.d[0]
    s = c.sender(p, 9)
    r = c.receiver(d, 9, [1, 2])  # the destination reaches prefill at 41 ms, its check ends at 46 ms
    c.run_ms(43)
    c.w.drive(p, "declare_dead", d.name, PeerUnreachable("unheard for 4.0s"))
    c.run_ms(100)
    assert s.state is SenderState.FAILED and c.finished_ms(s) == 46.0
    assert s.reason is not None
    assert "registration session that ended before it arrived" in s.reason
    assert r.state is ReceiverState.FAILED
    c.w.drive(p, "clear_sender", s)
    c.w.drive(d, "clear_receiver", r)
    c.run_ms(110)
    assert all(v == 0 for v in p.core.room_counts().values()), p.core.room_counts()
    c.check()
