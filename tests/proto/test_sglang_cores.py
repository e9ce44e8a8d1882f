"""The two sans-IO cores of SGLang 0.5.10's wire, driven by hand with explicit times.

``SglangPrefillCore`` serves stock SGLang decode ranks (their registration and transfer infos
in, NIXL writes carrying SGLang's notification strings out, never a ZMQ reply);
``SglangDecodeCore`` receives from stock SGLang prefill ranks (its ``GET /route`` look-up,
``GET /health`` checks, completion counted from notifications, the waiting timeout). Each test
attacks one promise of the modules' docstrings; no network, no sleeps.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np
import pytest

from asynckv.config import Config
from asynckv.errors import (
    Aborted,
    ClosedError,
    InvalidArgument,
    LayoutMismatch,
    PeerUnreachable,
    RemoteProtocolError,
    TransferTimeout,
    WaitingTimeout,
)
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.receiver import ReceiverRoom
from asynckv.proto.sender import DecodePeer, PeerPhase, SenderRoom
from asynckv.proto.sglang import SglangMessage, SglangRegister, SglangTransferInfo
from asynckv.proto.sglang_decode import CheckHealth, SglangDecodeCore, SglangPrefill
from asynckv.proto.sglang_prefill import SglangPrefillCore
from asynckv.proto.states import KVPoll, ReceiverState, SenderState
from asynckv.proto.topology import stub_agent_metadata
from asynckv.testing import KVPool

WIRE = "sglang-0.5.10"
DECODE = "3f2b6c1e-8a4d-4e0f-9b7a-2c5d1e6f7a80"
"""A stock SGLang decode's NIXL agent name (a uuid4, as SGLang names them)."""
OTHER = "9a1c0d2e-1111-4e0f-9b7a-000000000002"
PAGE_BYTES = 2 * 64
"""Bytes of one page over both KV entries of ``pool()`` (what one page of a chunk posts)."""
BIG_ROOM = 4535838703865032264
"""A room id as SGLang draws them (random 63-bit)."""


def pool(entries: int = 2) -> KVPool:
    return KVPool(entries, 32, 64, aux_rows=8, aux_buffers=2)


def kv_args(entries: int = 2, **fields: Any) -> KVArgs:
    return pool(entries).kv_args(16, **fields)


def config(**fields: Any) -> Config:
    return Config(wire=WIRE, **fields)


def pages(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# -- prefill: an asynckv prefill rank serving stock SGLang decode ranks --------------------------


def registration(agent: str = DECODE, kv_buffers: int = 2, tp_size: int = 1, aux_buffers: int = 2,
                 port: int = 42577) -> SglangRegister:
    """What a stock SGLang 0.5.10 decode rank sends once per prefill rank."""
    return SglangRegister(
        ip="127.0.0.1", port=port, agent_name=agent, agent_metadata=stub_agent_metadata(agent),
        kv_ptrs=tuple(0x7F00_0000_0000 + i * 0x10_0000 for i in range(kv_buffers)),
        aux_ptrs=tuple(0x7E00_0000_0000 + i * 0x1000 for i in range(aux_buffers)), state_ptrs=(), gpu_id=0,
        tp_size=tp_size, engine_rank=0, kv_item_len=64)


def transfer_info(room: int, dst: list[int], aux: int = 3, agent: str = DECODE,
                  state: list[int] | None = None, port: int = 42577) -> SglangTransferInfo:
    """What a stock SGLang decode rank sends per room."""
    return SglangTransferInfo(room, "127.0.0.1", port, agent, np.array(dst, dtype=np.int32), aux, 1,
                              np.array(state or [], dtype=np.int32))


def deliver(core: SglangPrefillCore, msg: SglangMessage, now: float) -> None:
    """A decoded message of SGLang's wire (``receive`` is annotated with asynckv's own messages only)."""
    core.receive(msg, now)


def state(room: SenderRoom) -> SenderState:
    """The room's state, read afresh (each call is a new read for the type checker too)."""
    return room.state


def take(core: SglangPrefillCore) -> list[act.Action]:
    """The core's actions; a stock SGLang decode reads no reply, so none may be a ``Send``."""
    out = core.actions()
    sends = [a for a in out if isinstance(a, act.Send)]
    assert sends == [], f"a Send to a stock SGLang decode would be foreign traffic there: {sends}"
    return out


def of(kind: type[Any], actions: list[act.Action]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def prefill(cfg: Config | None = None, args: KVArgs | None = None) -> SglangPrefillCore:
    return SglangPrefillCore("prefill-incarnation-1", "tcp://127.0.0.1:17000", args or kv_args(), cfg or config())


def register(core: SglangPrefillCore, reg: SglangRegister | None = None, now: float = 0.0) -> DecodePeer:
    """A stock decode registers; returns the peer the core asks the data plane to connect."""
    deliver(core, reg or registration(), now)
    [connect] = of(act.ConnectPeer, take(core))
    peer: DecodePeer = connect.peer
    return peer


def connected(cfg: Config | None = None) -> tuple[SglangPrefillCore, DecodePeer]:
    core = prefill(cfg)
    peer = register(core)
    core.peer_connected(peer, None, 0.01)
    take(core)
    return core, peer


def ready_sender(core: SglangPrefillCore, room: int, dst: list[int], aux: int = 3, now: float = 0.1) -> SenderRoom:
    sender = core.open_sender(room, now)
    deliver(core, transfer_info(room, dst, aux), now)
    assert of(act.RoomReady, take(core)) != [], sender
    return sender


def settle_all(core: SglangPrefillCore, now: float, error: BaseException | None = None) -> list[act.Action]:
    """Settle every post in flight, oldest first, until none is left; every action that followed."""
    out: list[act.Action] = []
    while core.posts:
        core.post_settled(min(core.posts), error, now)
        out += take(core)
    return out


def test_prefill_a_stock_decodes_registration_connects_it_and_is_answered_by_nothing() -> None:
    core = prefill()
    deliver(core, registration(), 0.0)
    out = take(core)
    assert [type(a) for a in out] == [act.ConnectPeer]
    [connect] = of(act.ConnectPeer, out)
    peer = connect.peer
    assert (peer.name, peer.endpoint, peer.phase, peer.pool_known) == (
        DECODE, "tcp://127.0.0.1:42577", PeerPhase.CONNECTING, False)
    assert peer.reg.agent_metadata == stub_agent_metadata(DECODE)  # handed to NIXL to load
    core.peer_connected(peer, None, 0.25)
    out = take(core)  # asynckv's wire would answer RegisterResult(ok) here
    assert [type(a) for a in out] == [act.SetLease, act.PeerUp]
    assert out[0] == act.SetLease(DECODE, float("inf")) and out[1] == act.PeerUp(DECODE, 0.25)
    assert core.peers[DECODE].phase is PeerPhase.CONNECTED and core.stats["peers_added"] == 1
    assert core.get_timer() is None  # no heartbeat: SGLang's decode answers no pings


def test_prefill_a_transfer_info_that_came_while_its_peer_connects_is_applied_once_it_connected() -> None:
    core = prefill()
    peer = register(core)
    sender = core.open_sender(BIG_ROOM, 0.01)
    deliver(core, transfer_info(BIG_ROOM, [5, 6], aux=2), 0.02)  # SGLang sends it right after its registration
    assert take(core) == [] and sender.state is SenderState.BOOTSTRAPPING
    assert core.room_counts()["connecting_destinations"] == 1
    core.peer_connected(peer, None, 0.03)
    out = take(core)
    assert of(act.RoomReady, out) != [] and state(sender) is SenderState.READY
    assert core.room_counts()["connecting_destinations"] == 0
    core.sender_init(sender, 2, 1, 0.04)
    core.send_chunk(sender, pages(0, 1), None, 0.04)
    posts = of(act.Post, take(core))
    assert [(p.kind, p.dst.tolist(), p.notif) for p in posts] == [
        ("kv", [5, 6], f"{BIG_ROOM}_kv_0_1_0".encode()), ("aux", [2], f"{BIG_ROOM}_aux".encode())]


def test_prefill_held_transfer_infos_are_dropped_and_counted_when_their_peer_fails_to_connect(
        caplog: pytest.LogCaptureFixture) -> None:
    core = prefill()
    peer = register(core)
    sender = core.open_sender(7, 0.01)
    deliver(core, transfer_info(7, [1]), 0.02)
    deliver(core, transfer_info(8, [2]), 0.02)
    assert core.room_counts()["connecting_destinations"] == 2
    with caplog.at_level(logging.WARNING, logger="asynckv.prefill"):
        core.peer_connected(peer, RemoteProtocolError("cannot load its agent metadata"), 0.03)
    out = take(core)  # asynckv's wire would answer RegisterResult(refused) here
    assert of(act.RoomReady, out) == [] and of(act.Post, out) == []
    assert core.stats["dropped_held"] >= 1 and core.stats["peers_refused"] == 1
    assert DECODE not in core.peers and core.room_counts()["connecting_destinations"] == 0
    assert "cannot load its agent metadata" in caplog.text
    assert sender.state is SenderState.BOOTSTRAPPING  # never applied: it fails at its bootstrap timeout
    deliver(core, transfer_info(9, [3]), 0.04)  # and what that decode sends later is not acted on either
    assert take(core) == [] and core.stats["dropped_unknown_peer"] == 1
    core.handle_timer(core.config.bootstrap_timeout_s + 1)
    assert sender.poll() == KVPoll.Failed and take(core) != []


def test_prefill_no_path_sends_anything_to_a_stock_decode() -> None:
    """Success, failure (with and without writes in flight), refusal and close: each would answer the
    decode on asynckv's wire (Status, RegisterResult, Bye); here every one is swallowed (``take``)."""
    core, peer = connected()
    ok = ready_sender(core, 1, [1])
    core.sender_init(ok, 1, 0, 0.1)
    core.send_chunk(ok, pages(0), None, 0.1)
    take(core)
    settle_all(core, 0.2)
    assert ok.poll() == KVPoll.Success
    failed = ready_sender(core, 2, [2])
    core.sender_init(failed, 1, 0, 0.2)
    core.send_chunk(failed, pages(1), None, 0.2)
    take(core)
    core.abort_sender(failed, Aborted("scheduler aborted"), 0.3)
    take(core)
    settle_all(core, 0.3, Aborted("cancelled"))
    assert failed.poll() == KVPoll.Failed and core.stats["sglang_failures_untold"] == 1
    deliver(core, transfer_info(3, [1], state=[4]), 0.4)  # refused before any sender: dropped, untold
    take(core)
    deliver(core, registration(OTHER, kv_buffers=4), 0.4)
    take(core)
    core.close(0.5)
    assert of(act.Closed, take(core)) != [] and peer.phase is PeerPhase.DRAINING


@pytest.mark.parametrize("budget", [8 * 2**30, PAGE_BYTES], ids=["no-wait", "chunks-wait-for-the-byte-budget"])
def test_prefill_notifications_count_the_chunks_and_mark_only_the_last(budget: int) -> None:
    core, _peer = connected(config(max_inflight_bytes=budget))
    sender = ready_sender(core, BIG_ROOM, [10, 11, 12, 13], aux=5)
    core.sender_init(sender, 4, 1, 0.1)
    posts: list[act.Post] = []
    for chunk, src in enumerate([pages(0), pages(1, 2), pages(3)]):
        assert core.send_chunk(sender, src, None, 0.1 + chunk / 100) == chunk
        posts += of(act.Post, take(core))
    if budget == PAGE_BYTES:  # chunks 1 and 2 (and the aux row) wait for chunk 0's write to land
        assert len(posts) == 1 and core.room_counts()["queued_writes"] == 3
        while core.posts:
            core.post_settled(min(core.posts), None, 0.2)
            new = of(act.Post, take(core))
            assert len(new) <= 1  # the budget lets one write go at a time
            posts += new
    else:
        settle_all(core, 0.2)
    assert [(p.kind, p.dst.tolist(), p.notif.decode()) for p in posts] == [
        ("kv", [10], f"{BIG_ROOM}_kv_0_0_0"),
        ("kv", [11, 12], f"{BIG_ROOM}_kv_1_0_0"),
        ("kv", [13], f"{BIG_ROOM}_kv_2_1_0"),
        ("aux", [5], f"{BIG_ROOM}_aux"),
    ]
    assert sender.poll() == KVPoll.Success


def test_prefill_a_room_failing_with_writes_in_flight_cancels_them_and_posts_nothing_later() -> None:
    core, _peer = connected(config(max_inflight_bytes=PAGE_BYTES))
    sender = ready_sender(core, 21, [4, 5, 6], aux=1)
    core.sender_init(sender, 3, 0, 0.1)
    core.send_chunk(sender, pages(0), None, 0.1)
    core.send_chunk(sender, pages(1, 2), None, 0.1)  # the last chunk: its KV and aux writes wait
    [first] = of(act.Post, take(core))
    assert core.room_counts()["queued_writes"] == 2
    core.abort_sender(sender, Aborted("request aborted by the scheduler"), 0.2)
    out = take(core)
    assert of(act.CancelPosts, out) == [act.CancelPosts((first.post_id,), sender.exception or Aborted())]
    assert sender.poll() == KVPoll.Failed and sender.state is SenderState.DRAINING
    core.post_settled(first.post_id, TransferTimeout("cancelled"), 0.3)  # (a cancelled write sends no notif)
    out = take(core)
    assert of(act.Post, out) == [] and state(sender) is SenderState.FAILED
    assert core.send_chunk(sender, pages(3), None, 0.4) is None and take(core) == []
    counts = core.room_counts()
    assert (counts["queued_writes"], counts["posts"], counts["inflight_bytes"]) == (0, 0, 0)
    assert core.stats["sglang_failures_untold"] == 1


def test_prefill_a_decode_dropped_on_a_nixl_error_is_connected_anew_when_it_sends_again() -> None:
    """SGLang's decode registers once: a peer dropped on one NIXL error (a false death) would refuse
    that decode for good. Its next transfer info connects it again from the kept registration."""
    core, _peer = connected(config())
    sender = ready_sender(core, 41, [4], aux=1)
    core.sender_init(sender, 1, 0, 0.1)
    core.send_chunk(sender, pages(0), None, 0.1)
    [kv, _aux] = of(act.Post, take(core))
    core.post_settled(kv.post_id, PeerUnreachable("nixlRemoteDisconnectError"), 0.2)
    assert of(act.DisconnectPeer, take(core)) != [] and DECODE not in core.peers
    later = core.open_sender(42, 0.3)
    deliver(core, transfer_info(42, [7], aux=2), 0.4)
    [connect] = of(act.ConnectPeer, take(core))
    assert connect.peer.name == DECODE and core.stats["sglang_reconnects"] == 1
    core.peer_connected(connect.peer, None, 0.5)
    take(core)
    assert later.state is SenderState.READY  # the held destination applied once it connected
    core.sender_init(later, 1, 0, 0.6)
    core.send_chunk(later, pages(3), None, 0.6)
    assert [p.notif for p in of(act.Post, take(core))] == [b"42_kv_0_1_0", b"42_aux"]


def test_prefill_a_registration_that_failed_to_connect_is_not_retried() -> None:
    core = prefill()
    peer = register(core)
    core.peer_connected(peer, RemoteProtocolError("cannot load its metadata"), 0.1)
    take(core)
    deliver(core, transfer_info(43, [1], aux=0), 0.2)
    assert of(act.ConnectPeer, take(core)) == [] and core.stats.get("sglang_reconnects", 0) == 0


@pytest.mark.parametrize("info, field", [
    (transfer_info(31, [1, 2], state=[0]), "state indices"),
    (transfer_info(31, [1, 2], aux=-1), "aux index -1"),
], ids=["state-indices", "aux-minus-one"])
def test_prefill_a_destination_out_of_scope_fails_its_room_naming_the_field(info: SglangTransferInfo,
                                                                            field: str) -> None:
    core, _peer = connected()
    sender = core.open_sender(31, 0.1)
    deliver(core, info, 0.1)
    out = take(core)
    assert of(act.Finished, out) != [] and of(act.Post, out) == []
    assert sender.poll() == KVPoll.Failed and isinstance(sender.exception, RemoteProtocolError)
    assert field in (sender.reason or "")
    core.sender_init(sender, 2, 0, 0.2)
    assert core.send_chunk(sender, pages(0, 1), None, 0.2) is None and of(act.Post, take(core)) == []


def test_prefill_sender_calls_out_of_scope_are_refused_naming_the_field() -> None:
    core, _peer = connected()
    sender = ready_sender(core, 41, [1, 2])
    with pytest.raises(InvalidArgument, match="num_pages 0"):
        core.sender_init(sender, 0, 0, 0.1)
    with pytest.raises(InvalidArgument, match="aux_index -1"):
        core.sender_init(sender, 2, -1, 0.1)
    core.sender_init(sender, 2, 0, 0.1)
    with pytest.raises(InvalidArgument, match="empty chunk"):
        core.send_chunk(sender, pages(), None, 0.1)
    with pytest.raises(InvalidArgument, match="state indices"):
        core.send_chunk(sender, pages(0, 1), pages(0), 0.1)
    assert take(core) == [] and sender.state is SenderState.READY  # refused calls change nothing
    core.send_chunk(sender, pages(0, 1), None, 0.2)
    assert [p.notif for p in of(act.Post, take(core))] == [b"41_kv_0_1_0", b"41_aux"]


def test_prefill_a_duplicate_registration_is_dropped() -> None:
    core = prefill()
    peer = register(core)
    deliver(core, registration(), 0.01)  # while the first one connects
    assert take(core) == []
    core.peer_connected(peer, None, 0.02)
    take(core)
    deliver(core, registration(port=42999), 0.03)  # and once connected (even from another port)
    assert take(core) == [] and core.stats["dropped_duplicate"] == 2
    assert core.peers[DECODE] is peer and peer.endpoint == "tcp://127.0.0.1:42577"


@pytest.mark.parametrize("reg, args, field", [
    (registration(kv_buffers=4), kv_args(), "kv pointers"),
    (registration(tp_size=2), kv_args(), "decode tp size"),
    (registration(aux_buffers=3), kv_args(), "number of aux buffers"),
], ids=["another-number-of-kv-buffers", "another-tp-for-mha", "another-number-of-aux-buffers"])
def test_prefill_a_registration_it_cannot_serve_is_refused_and_logged(
        reg: SglangRegister, args: KVArgs, field: str, caplog: pytest.LogCaptureFixture) -> None:
    core = prefill(args=args)
    with caplog.at_level(logging.WARNING, logger="asynckv.prefill"):
        deliver(core, reg, 0.0)
    assert take(core) == [] and DECODE not in core.peers and core.stats["peers_refused"] == 1
    assert field in caplog.text and DECODE[:8] in caplog.text
    sender = core.open_sender(1, 0.1)
    deliver(core, transfer_info(1, [1]), 0.1)  # its rooms are never served
    assert of(act.RoomReady, take(core)) == [] and sender.state is SenderState.BOOTSTRAPPING


def test_prefill_mla_serves_a_decode_of_another_tp_size() -> None:
    core = prefill(args=kv_args(entries=1, is_mla=True))
    deliver(core, registration(kv_buffers=1, tp_size=2), 0.0)
    assert of(act.ConnectPeer, take(core)) != []


def test_prefill_room_counts_are_all_zero_after_clear_and_close() -> None:
    core, _peer = connected(config(max_inflight_bytes=PAGE_BYTES))
    done = ready_sender(core, 1, [1])
    core.sender_init(done, 1, 0, 0.1)
    core.send_chunk(done, pages(0), None, 0.1)
    take(core)
    settle_all(core, 0.2)
    core.clear_sender(done, 0.2)
    inflight = ready_sender(core, 2, [2, 3])
    core.sender_init(inflight, 2, 0, 0.3)
    core.send_chunk(inflight, pages(1, 2), None, 0.3)  # KV in flight, aux waits for the budget
    take(core)
    core.clear_sender(inflight, 0.3)  # draining until its write settles
    deliver(core, transfer_info(3, [4]), 0.3)  # a destination whose sender never comes (early table)
    late = register(core, registration(OTHER, port=43000), 0.3)
    deliver(core, transfer_info(4, [5], agent=OTHER, port=43000), 0.3)  # held: OTHER is still connecting
    take(core)
    counts = core.room_counts()
    assert counts["draining_rooms"] == 1 and counts["early_rooms"] == 1 and counts["connecting_destinations"] == 1
    core.close(0.4)
    out = take(core)
    assert of(act.Closed, out) == []  # a write and a connection are still settling
    settle_all(core, 0.5, Aborted("cancelled"))
    core.peer_connected(late, None, 0.6)  # the data plane answers the connect it was busy with
    out = take(core)
    assert of(act.Closed, out) != [] and of(act.Post, out) == []
    assert core.room_counts() == dict.fromkeys(core.room_counts(), 0), core.room_counts()
    assert core.peers == {} and core.retired == {}


# -- decode: an asynckv decode rank receiving from stock SGLang prefill ranks ---------------------

ADDR = "10.0.0.1:8998"
ADDR_B = "10.0.0.2:8998"
EP = "tcp://10.0.0.1:17000"
EP_B = "tcp://10.0.0.2:17000"
PREFILL_AGENT = "prefill-agent-aaaa"


def topology(endpoints: dict[int, str] | None = None, **fields: Any) -> SglangPrefill:
    values: dict[str, Any] = dict(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=16,
                                  kv_cache_dtype="auto", follow_bootstrap_room=False)
    values.update(fields)
    return SglangPrefill(**values, endpoints=endpoints if endpoints is not None else {0: EP})


def decode(cfg: Config | None = None) -> SglangDecodeCore:
    me = "decode-agent-0001"
    reg = SglangRegister("10.0.0.9", 5000, me, stub_agent_metadata(me), (0x1000, 0x2000), (0x3000, 0x4000), (),
                         0, 1, 0, 64)
    return SglangDecodeCore(me, "tcp://10.0.0.9:5000", kv_args(), cfg or config(), reg)


def receiver(core: SglangDecodeCore, room: int, addr: str = ADDR, dst: tuple[int, ...] = (1, 2), aux: int = 3,
             now: float = 0.0) -> ReceiverRoom:
    r = core.open_receiver(addr, room, now)
    core.receiver_init(r, list(dst), aux, None, 0, now)
    return r


def waiting(core: SglangDecodeCore, room: int, addr: str = ADDR, now: float = 0.0) -> ReceiverRoom:
    """A room whose transfer info went out (the topology of ``addr`` fetched if needed)."""
    r = receiver(core, room, addr, now=now)
    if r.state is ReceiverState.RESOLVING:
        core.topology_fetched(addr, topology({0: EP if addr == ADDR else EP_B}), now)
    assert r.state is ReceiverState.WAITING, r
    return r


def sends(out: list[act.Action]) -> list[tuple[str, str, int | None]]:
    """(endpoint, message kind, room) of each Send."""
    return [(a.endpoint, type(a.msg).__name__, getattr(a.msg, "room", None)) for a in of(act.Send, out)]


def test_decode_init_fetches_each_address_once_for_concurrent_rooms() -> None:
    core = decode()
    for room, addr in ((1, ADDR), (2, ADDR), (3, ADDR_B), (4, ADDR)):
        receiver(core, room, addr)
    assert core.actions() == [act.FetchTopology(ADDR), act.FetchTopology(ADDR_B)]
    assert core.room_counts()["fetching"] == 4
    core.topology_fetched(ADDR, topology(), 0.1)
    out = core.actions()
    assert sends(out) == [(EP, "SglangRegister", None), (EP, "SglangTransferInfo", 1),
                          (EP, "SglangTransferInfo", 2), (EP, "SglangTransferInfo", 4)]
    assert len(of(act.InitDone, out)) == 3 and core.rooms[3].state is ReceiverState.RESOLVING
    receiver(core, 5, ADDR, now=0.2)  # the instance is known now: no look-up
    assert sends(core.actions()) == [(EP, "SglangTransferInfo", 5)]


@pytest.mark.parametrize("fields, field", [
    ({"page_size": 32}, "page_size"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype"),
    ({"attn_tp_size": 2}, "attn_tp_size"),
    ({"attn_cp_size": 2}, "attn_cp_size"),
    ({"pp_size": 2}, "pp_size"),
    ({"dp_size": 2, "follow_bootstrap_room": False}, "follow_bootstrap_room"),
])
def test_decode_a_prefill_it_cannot_receive_from_fails_the_rooms_naming_the_field(fields: dict[str, Any],
                                                                                  field: str) -> None:
    core = decode()
    rooms = [receiver(core, room) for room in (1, 2)]
    core.actions()
    core.topology_fetched(ADDR, topology({0: EP, 1: EP}, **fields), 0.1)
    out = core.actions()
    assert sends(out) == [] and len(of(act.Finished, out)) == 2
    for r in rooms:
        assert r.poll() == KVPoll.Failed and isinstance(r.exception, LayoutMismatch)
        assert field in (r.reason or "")
    assert core.instance(ADDR) is None
    receiver(core, 3, now=0.2)  # a refused instance is not kept: the next room looks it up again
    assert core.actions() == [act.FetchTopology(ADDR)]


def test_decode_a_failed_look_up_fails_its_rooms_with_that_error() -> None:
    core = decode()
    r = receiver(core, 1)
    core.actions()
    core.topology_fetched(ADDR, PeerUnreachable("GET /route: connection refused"), 0.1)
    assert r.poll() == KVPoll.Failed and "connection refused" in (r.reason or "") and sends(core.actions()) == []


def test_decode_registers_once_per_prefill_endpoint_before_its_first_transfer_info() -> None:
    core = decode()
    for room in (10, 11, 12, 13):
        receiver(core, room, dst=(room,), aux=room % 8)
    core.actions()
    core.topology_fetched(ADDR, topology({0: EP, 1: EP_B}, dp_size=2, follow_bootstrap_room=True), 0.1)
    out = core.actions()
    assert sends(out) == [(EP, "SglangRegister", None), (EP, "SglangTransferInfo", 10),
                          (EP_B, "SglangRegister", None), (EP_B, "SglangTransferInfo", 11),
                          (EP, "SglangTransferInfo", 12), (EP_B, "SglangTransferInfo", 13)]
    for a in of(act.Send, out):
        msg = a.msg
        if isinstance(msg, SglangRegister):
            assert msg is core.register
        else:
            assert isinstance(msg, SglangTransferInfo)
            assert msg.dst_pages.tolist() == [msg.room] and msg.aux_index == msg.room % 8
            assert (msg.agent_name, msg.ip, msg.port) == (core.register.agent_name, "10.0.0.9", 5000)
            assert msg.required_dst_info_num == 1 and msg.state_indices.size == 0 and not msg.is_dummy
    receiver(core, 14, dst=(14,), now=0.2)
    assert sends(core.actions()) == [(EP, "SglangTransferInfo", 14)]  # registered already


def test_decode_completes_only_once_the_aux_row_and_every_chunk_arrived_in_any_order() -> None:
    notes = [b"kv_0_0_0", b"kv_1_0_0", b"kv_2_1_0", b"aux"]
    core = decode()
    for n, order in enumerate(itertools.permutations(notes)):
        room = 100 + n
        r = waiting(core, room, now=n)
        core.actions()
        for i, note in enumerate(order):
            core.notified(PREFILL_AGENT, f"{room}_".encode() + note, n + 0.1)
            finished = of(act.Finished, core.actions())
            assert (finished != []) == (i == len(order) - 1), (order, i)
        assert r.poll() == KVPoll.Success, order
        core.clear_receiver(r, n + 0.2)
    assert core.room_counts() == dict.fromkeys(core.room_counts(), 0)


@pytest.mark.parametrize("notes, why", [
    ([b"kv_0_1_0", b"kv_1_0_0"], "after its last chunk"),
    ([b"kv_1_0_0", b"kv_0_1_0"], "after its last chunk"),
    ([b"kv_0_1_0", b"kv_1_1_0"], "two last chunks"),
    ([b"kv_0_0_0", b"kv_0_1_1"], "pp rank 1"),
])
def test_decode_a_chunk_sglang_would_wait_on_forever_fails_the_room(notes: list[bytes], why: str) -> None:
    core = decode()
    r = waiting(core, 7)
    core.actions()
    for note in notes:
        core.notified(PREFILL_AGENT, b"7_" + note, 0.1)
    assert of(act.Finished, core.actions()) != []  # at once: SGLang would wait for its timeout
    assert r.poll() == KVPoll.Failed and isinstance(r.exception, RemoteProtocolError) and why in (r.reason or "")


def test_decode_notifications_of_a_second_agent_for_the_room_are_dropped() -> None:
    core = decode()
    r = waiting(core, 7)
    core.actions()
    core.notified(PREFILL_AGENT, b"7_kv_0_1_0", 0.1)
    core.notified("another-prefill-agent", b"7_aux", 0.2)  # it does not write this room
    assert core.actions() == [] and r.state is ReceiverState.WAITING and core.stats["dropped_other_agent"] == 1
    core.notified(PREFILL_AGENT, b"7_aux", 0.3)
    assert of(act.Finished, core.actions()) != [] and r.poll() == KVPoll.Success


def test_decode_a_notification_for_a_failed_room_counts_as_late() -> None:
    core = decode()
    r = waiting(core, 7)
    core.actions()
    core.abort_receiver(r, Aborted("client went away"), 0.1)
    assert of(act.Finished, core.actions()) != [] and r.poll() == KVPoll.Failed  # no fence on this wire
    core.notified(PREFILL_AGENT, b"7_kv_0_1_0", 0.2)  # the stock prefill wrote after all
    assert core.actions() == [] and core.stats["late_notification"] == 1 and r.poll() == KVPoll.Failed
    core.clear_receiver(r, 0.3)
    core.notified(PREFILL_AGENT, b"7_aux", 0.4)
    assert core.stats["late_notification"] == 1 and core.stats["dropped_unknown_room"] == 1
    core.notified(PREFILL_AGENT, b"7_bogus", 0.5)
    assert core.stats["dropped_bad_notification"] == 1


def health_round(core: SglangDecodeCore, now: float, answers: dict[str, str | None]) -> list[act.Action]:
    """Run the timer at ``now`` (it is due): one health check per watched address, answered as given."""
    timer = core.get_timer()
    assert timer is not None and timer <= now
    core.handle_timer(now)
    checks = of(CheckHealth, core.actions())
    assert sorted(c.addr for c in checks) == sorted(answers)
    for addr, error in answers.items():
        core.health_checked(addr, error, now + 0.01)
    return core.actions()


def test_decode_consecutive_failed_health_checks_fail_the_rooms_and_the_next_room_registers_again() -> None:
    core = decode(config(heartbeat_interval_s=1.0, heartbeat_max_failures=3, waiting_timeout_s=100))
    a1, a2 = waiting(core, 1), waiting(core, 2)
    b = waiting(core, 3, ADDR_B)
    core.actions()
    script: list[str | None] = ["refused", "refused", None, "refused", "refused"]  # a success resets the count
    for i, error in enumerate(script):
        assert health_round(core, float(i), {ADDR: error, ADDR_B: None}) == []
        assert core.get_timer() == i + 1.0  # every heartbeat_interval_s
    assert a1.state is a2.state is ReceiverState.WAITING
    out = health_round(core, 5.0, {ADDR: "refused", ADDR_B: None})  # the third failure in a row
    assert len(of(act.Finished, out)) == 2
    for r in (a1, a2):
        assert r.poll() == KVPoll.Failed and isinstance(r.exception, PeerUnreachable)
        assert "3 health checks" in (r.reason or "")
    assert b.state is ReceiverState.WAITING and core.instance(ADDR) is None
    assert health_round(core, 6.0, {ADDR_B: None}) == []  # the failed rooms are not watched any more
    receiver(core, 4, now=6.5)  # the prefill is looked up again, and registered with again
    assert core.actions() == [act.FetchTopology(ADDR)]
    core.topology_fetched(ADDR, topology(), 6.6)
    assert sends(core.actions()) == [(EP, "SglangRegister", None), (EP, "SglangTransferInfo", 4)]


def test_decode_failed_health_checks_before_an_idle_period_do_not_fail_a_later_room() -> None:
    core = decode(config(heartbeat_interval_s=1.0, heartbeat_max_failures=3, waiting_timeout_s=10_000))
    first = waiting(core, 1)
    core.actions()
    for now in (0.0, 1.0):
        health_round(core, now, {ADDR: "connection refused"})
    core.notified(PREFILL_AGENT, b"1_kv_0_1_0", 1.5)
    core.notified(PREFILL_AGENT, b"1_aux", 1.5)
    assert first.poll() == KVPoll.Success and core.get_timer() is None  # nothing waits: no checks for an hour
    later = waiting(core, 2, now=3600.0)
    core.actions()
    health_round(core, 3600.0, {ADDR: "one transient failure"})
    assert later.state is ReceiverState.WAITING, later.reason  # one failed check of its own: 3 in a row needed


def test_decode_one_health_check_at_a_time_and_none_without_waiting_rooms() -> None:
    core = decode(config(heartbeat_interval_s=1.0, heartbeat_max_failures=3, waiting_timeout_s=100))
    r = receiver(core, 1)
    core.actions()
    assert core.get_timer() == 100.0  # resolving rooms are not checked: only the waiting timeout
    core.topology_fetched(ADDR, topology(), 0.0)
    core.actions()
    core.handle_timer(0.0)
    assert of(CheckHealth, core.actions()) == [CheckHealth(ADDR, 2.0)]
    core.handle_timer(1.0)  # the first one is not answered yet
    assert of(CheckHealth, core.actions()) == []
    core.notified(PREFILL_AGENT, b"1_kv_0_1_0", 1.5)
    core.notified(PREFILL_AGENT, b"1_aux", 1.5)
    assert r.poll() == KVPoll.Success
    core.health_checked(ADDR, "timed out", 1.6)
    core.actions()
    assert core.get_timer() is None


def test_decode_waiting_timeout_fails_the_room() -> None:
    core = decode(config(waiting_timeout_s=10.0, heartbeat_interval_s=4.0))
    resolving = receiver(core, 1, ADDR_B)  # its look-up never answers
    r = waiting(core, 2)
    core.actions()
    for now in (0.0, 4.0, 8.0):
        health_round(core, now, {ADDR: None})
    core.handle_timer(9.99)
    assert core.actions() == [] and r.state is ReceiverState.WAITING
    assert core.get_timer() == 10.0
    core.handle_timer(10.0)
    out = core.actions()
    assert len(of(act.Finished, out)) == 2
    for room in (resolving, r):
        assert room.poll() == KVPoll.Failed and isinstance(room.exception, WaitingTimeout)
        assert "10.0s" in (room.reason or "")
    core.topology_fetched(ADDR_B, topology({0: EP_B}), 10.5)  # the look-up answers too late
    assert sends(core.actions()) == [] and resolving.poll() == KVPoll.Failed


def test_decode_abort_clear_and_close_leave_no_table_entries() -> None:
    core = decode()
    aborted = waiting(core, 1)
    partial = waiting(core, 2)
    core.notified(PREFILL_AGENT, b"2_kv_0_0_0", 0.1)  # it has a writer and progress
    resolving = receiver(core, 3, ADDR_B)
    created = core.open_receiver(ADDR, 4, 0.1)
    core.abort_receiver(aborted, Aborted("client went away"), 0.2)
    core.clear_receiver(aborted, 0.2)
    core.clear_receiver(resolving, 0.2)  # cleared while its look-up is in flight
    assert resolving.poll() == KVPoll.Failed and core.room_counts()["fetching"] == 0
    core.actions()
    core.close(0.3)
    out = core.actions()
    assert of(act.Closed, out) != [] and core.closed
    for r in (partial, created):
        assert r.poll() == KVPoll.Failed and isinstance(r.exception, ClosedError)
    assert core.room_counts() == dict.fromkeys(core.room_counts(), 0), core.room_counts()
    core.topology_fetched(ADDR_B, topology({0: EP_B}), 0.4)  # answers after close change nothing
    core.notified(PREFILL_AGENT, b"2_aux", 0.4)
    assert core.actions() == [] and core.room_counts() == dict.fromkeys(core.room_counts(), 0)
    with pytest.raises(ClosedError):
        core.open_receiver(ADDR, 5, 0.5)


@pytest.mark.parametrize("dst, aux, state, prefix, field", [
    ((), 3, None, 0, "page_indices"),
    ((1, 2), -1, None, 0, "aux_index"),
    ((1, 2), 99, None, 0, "aux_index"),
    ((1, 2), 3, [0], 0, "state_indices"),
    ((1, 2), 3, None, 16, "decode_prefix_len"),
], ids=["empty-pages", "aux-minus-one", "aux-out-of-range", "state-indices", "decode-prefix-len"])
def test_decode_init_refuses_what_this_wire_cannot_carry(dst: tuple[int, ...], aux: int, state: list[int] | None,
                                                         prefix: int, field: str) -> None:
    core = decode()
    r = core.open_receiver(ADDR, 1, 0.0)
    with pytest.raises(InvalidArgument, match=field):
        core.receiver_init(r, list(dst), aux, state, prefix, 0.0)
    assert core.actions() == [] and r.state is ReceiverState.CREATED and not r.initialized
    core.receiver_init(r, [1, 2], 3, None, 0, 0.1)  # a valid init still goes through
    assert core.actions() == [act.FetchTopology(ADDR)]


def test_decode_health_checks_that_time_out_still_count_in_a_row() -> None:
    """A SIGSTOPped prefill does not refuse, it hangs: each check fails only at its timeout, so failures
    come one timeout plus one interval apart. They are still in a row."""
    core = decode(config(heartbeat_interval_s=0.5, heartbeat_max_failures=4, waiting_timeout_s=10_000))
    room = waiting(core, 1)
    core.actions()
    now, checks = 0.0, 0
    while room.state is ReceiverState.WAITING and checks < 10:
        core.handle_timer(now)
        [check] = of(CheckHealth, core.actions())
        now += check.timeout_s  # no answer: the check times out
        core.health_checked(ADDR, "no answer within 1s", now)
        checks += 1
        now += 0.5  # the next beat
    assert room.state is ReceiverState.FAILED and checks == 4, (room.state, checks)


def test_decode_notifications_of_the_writers_other_lanes_count_as_the_writer() -> None:
    """An asynckv prefill posts from write lanes ``<name>.<i>``: the same rank, not a second writer;
    a look-alike suffix that is not a lane number is another agent."""
    core = decode()
    r = waiting(core, 7)
    core.actions()
    core.notified(f"{PREFILL_AGENT}.1", b"7_kv_0_0_0", 0.1)
    core.notified(f"{PREFILL_AGENT}.x", b"7_kv_1_1_0", 0.1)
    assert core.stats["dropped_other_agent"] == 1 and r.state is ReceiverState.WAITING
    core.notified(PREFILL_AGENT, b"7_kv_1_1_0", 0.2)
    core.notified(f"{PREFILL_AGENT}.2", b"7_aux", 0.3)
    assert r.poll() == KVPoll.Success
