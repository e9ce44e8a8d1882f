"""End-to-end transfers between two managers (two NIXL agents) over loopback."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from typing import Any, cast

import numpy as np
import pytest

from asynckv import ClosedError, Config, InvalidArgument, KVManager, KVPoll, LayoutMismatch, LocalProtocolError, Mode
from asynckv.service.decode import DecodeService
from asynckv.testing import KVPool, verify_pages
from asynckv.transport.lanes import LanedDataPlane
from asynckv.transport.merging import MERGE_MIN_POSTS

from .conftest import CONTROL, check_landed, make_pair, transfer_room

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("auth", ["", "s3cret"], ids=["open", "auth"])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("prepped", [True, False], ids=["prepped", "descs"])
@pytest.mark.parametrize("chunk", [None, 3], ids=["single", "chunked"])
async def test_pages_land_at_shuffled_destinations(mla: bool, prepped: bool, chunk: int | None, auth: str) -> None:
    async with make_pair(entries=3 if mla else 4, mla=mla, prepped_dlists=prepped, auth_token=auth) as pair:
        rng = np.random.default_rng(1)
        src = rng.permutation(64)[:10]
        dst = rng.permutation(64)[:10]
        assert await transfer_room(pair, 77, src, dst, chunk=chunk, src_aux=2, dst_aux=9) == (
            KVPoll.Success, KVPoll.Success)
        check_landed(pair, 77, dst, 9)
        untouched = np.setdiff1d(np.arange(64), dst)
        assert not pair.dpool.kv[:, untouched].any(), "a page outside the request was written"
        assert not np.concatenate([b[np.arange(16) != 9] for b in pair.dpool.aux]).any()
        pair.assert_no_room_state()


async def test_contiguous_runs_and_large_requests_split_across_handles() -> None:
    async with make_pair(pages=256, max_descs_per_xfer=7, prepped_dlists=False) as pair:
        src = np.arange(200)
        dst = np.concatenate([np.arange(100, 200), np.arange(0, 100)])
        assert await transfer_room(pair, 5, src, dst) == (KVPoll.Success, KVPoll.Success)
        check_landed(pair, 5, dst)


async def test_empty_last_chunk_concludes_the_room_and_carries_aux() -> None:
    async with make_pair() as pair:
        assert await transfer_room(pair, 9, [], [], src_aux=1, dst_aux=4) == (KVPoll.Success, KVPoll.Success)
        check_landed(pair, 9, [], 4)
        assert not pair.dpool.kv.any()


@pytest.mark.parametrize("auth", ["", "s3cret"], ids=["open", "auth"])
async def test_hundreds_of_rooms_in_flight_and_nothing_left_after_clear(auth: str) -> None:
    async with make_pair(entries=2, pages=1024, item=128, auth_token=auth) as pair:
        rng = np.random.default_rng(7)
        dst_all = rng.permutation(1024).reshape(128, 8)
        src_all = np.arange(1024).reshape(128, 8)
        results = await asyncio.gather(*(transfer_room(pair, 1000 + i, src_all[i], dst_all[i], chunk=3)
                                         for i in range(128)))
        assert results == [(KVPoll.Success, KVPoll.Success)] * 128
        for i in range(128):
            assert verify_pages(pair.dpool, 1000 + i, dst_all[i]) == 0
        pair.assert_no_room_state()
        assert pair.prefill.stats["kv_posts"] == 128 * 3


async def test_destination_may_arrive_before_the_sender_exists() -> None:
    async with make_pair() as pair:
        receiver = pair.decode.receiver(pair.addr, 3)
        assert await receiver.init([5, 6], -1) == KVPoll.WaitingForInput
        for _ in range(200):
            if pair.prefill.room_counts()["early_rooms"]:
                break
            await asyncio.sleep(0.005)
        assert pair.prefill.room_counts()["early_rooms"] == 1
        sender = pair.prefill.sender(3)
        assert sender.poll() == KVPoll.WaitingForInput
        sender.init(2)
        await sender.send([0, 1])
        assert await receiver.wait(5) == KVPoll.Success
        sender.clear()
        receiver.clear()
        pair.assert_no_room_state()


async def test_prefill_instance_with_connect_registers_before_the_first_room() -> None:
    """``prefill_instance(addr, connect=True)`` starts first contact (NIXL and UCX set-up, warm-up
    write) with no room open; the first room then finds the pair connected, and its bytes land."""
    async with make_pair() as pair:
        assert pair.prefill.snapshot()["peers"] == []
        instance = await pair.decode.prefill_instance(pair.addr, connect=True)
        counts = pair.decode.room_counts()
        assert instance.tp_size == 1 and counts["receivers"] == 0 and counts["registrations_pending"] == 1
        for _ in range(1000):
            peers = pair.prefill.snapshot()["peers"]
            if peers and peers[0]["phase"] == "connected":
                break
            await asyncio.sleep(0.005)
        assert [(p["peer"], p["phase"], p["rooms"]) for p in peers] == [(pair.decode.name, "connected", 0)]
        await pair.decode.prefill_instance(pair.addr, connect=True)  # again: nothing more to register
        assert len(pair.prefill.snapshot()["peers"]) == 1
        assert await transfer_room(pair, 4, [1, 2], [7, 9]) == (KVPoll.Success, KVPoll.Success)
        check_landed(pair, 4, [7, 9])
        assert [p["session"] for p in pair.prefill.snapshot()["peers"]] == [peers[0]["session"]]  # the same one
        pair.assert_no_room_state()


async def test_prefill_instance_refuses_a_prefill_this_rank_cannot_pair_with() -> None:
    async with make_pair(decode_fields={"page_size": 8}) as pair:
        with pytest.raises(LayoutMismatch, match="page_size"):
            await pair.decode.prefill_instance(pair.addr, connect=True)
        assert not any(pair.decode.room_counts().values()) and pair.prefill.snapshot()["peers"] == []


@pytest.mark.parametrize("stall", ["no answer", "not ready"])
async def test_closing_the_decode_during_a_prefill_look_up_raises_closed(stall: str) -> None:
    """close() while ``prefill_instance`` waits for the bootstrap server (which accepted the connection but
    does not answer, or answers 503 as its ranks are not all registered): the look-up raises ClosedError,
    not an error about the peer, and close() does not wait for the look-up's timeout."""
    accepted = asyncio.Event()

    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        try:
            while await reader.readuntil(b"\r\n\r\n"):  # (each request, read whole)
                if stall == "not ready":
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 2\r\n\r\n{}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    bootstrap = await asyncio.start_server(server, "127.0.0.1", 0)
    addr = f"127.0.0.1:{bootstrap.sockets[0].getsockname()[1]}"
    try:
        async with make_pair(handshake_timeout_s=60.0) as pair:
            look_up = asyncio.ensure_future(pair.decode.prefill_instance(addr, connect=True))
            await asyncio.wait_for(accepted.wait(), 5)
            await asyncio.sleep(0.05)  # (several 503s answered by now)
            await asyncio.wait_for(pair.decode.close(), 10)
            with pytest.raises(ClosedError):
                await asyncio.wait_for(look_up, 5)
    finally:
        bootstrap.close()
        await bootstrap.wait_closed()


async def test_a_look_up_answered_while_the_decode_closes_raises_closed() -> None:
    """The bootstrap server answers ``prefill_instance``'s look-up just as the decode closes: the look-up
    raises ClosedError rather than returning the topology of a prefill this closed rank can no longer use
    (found by review)."""
    async with make_pair() as pair:
        svc = cast(DecodeService | None, pair.decode._svc)
        assert svc is not None
        real, answered = svc.http.fetch_instance, asyncio.Event()

        async def held(addr: str, timeout_s: float) -> Any:
            instance = await real(addr, timeout_s)
            await answered.wait()  # (held until the close has begun)
            return instance

        svc.http.fetch_instance = held  # type: ignore[method-assign]
        look_up = asyncio.ensure_future(pair.decode.prefill_instance(pair.addr, connect=True))
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(pair.decode.close())
        for _ in range(200):
            if svc.core.closing:
                break
            await asyncio.sleep(0.005)
        answered.set()
        with pytest.raises(ClosedError):
            await asyncio.wait_for(look_up, 5)
        await asyncio.wait_for(closing, 10)


@pytest.mark.parametrize("wire", ["asynckv", "sglang-0.5.10"])
async def test_a_closed_manager_pins_no_memory(wire: str) -> None:
    """A running manager keeps its buffers' owners alive (NIXL has them registered) even once the caller dropped
    them; once closed, it lets them go at once, with no cyclic GC pass: its services live in reference cycles,
    and the owners held there kept each closed manager's pool until a collection (4 GiB a round in the
    reference workload, out of memory at its fifth round)."""
    cfg = Config(**(CONTROL if wire == "asynckv" else {}), wire=wire)
    gc.disable()
    try:
        ppool, dpool = KVPool(4, 64, 256, aux_rows=4), KVPool(4, 64, 256, aux_rows=4)
        pools = [weakref.ref(ppool.kv), weakref.ref(dpool.kv)]
        async with KVManager(Mode.PREFILL, ppool.kv_args(4), bootstrap_addr="127.0.0.1:0", config=cfg) as p, \
                KVManager(Mode.DECODE, dpool.kv_args(4), config=cfg) as d:
            del ppool, dpool
            receiver = d.receiver(p.bootstrap_addr or "", 1)
            await receiver.init([5, 6], 0)  # (SGLang's wire always sends an aux row)
            sender = p.sender(1)
            await sender.wait_ready(5)
            sender.init(2, 0)
            await sender.send([1, 2])
            assert await receiver.wait(5) == KVPoll.Success
            sender.clear()
            receiver.clear()
            del sender, receiver
            assert [ref() is not None for ref in pools] == [True, True]  # (registered: pinned while running)
        assert [ref() is None for ref in pools] == [True, True]
        assert p.kv_args.owners == d.kv_args.owners == () and p.kv_args.num_pages == 64
    finally:
        gc.enable()


async def test_bad_local_input_is_refused_and_nothing_is_lost() -> None:
    async with make_pair() as pair:
        receiver = pair.decode.receiver(pair.addr, 1)
        with pytest.raises(InvalidArgument, match="appears more than once"):
            await receiver.init([1, 1])
        with pytest.raises(InvalidArgument, match="outside the registered range"):
            await receiver.init([64])
        with pytest.raises(InvalidArgument, match="aux_index 16"):
            await receiver.init([1], 16)
        assert receiver.poll() == KVPoll.Bootstrapping  # still usable
        assert await receiver.init([1, 2]) == KVPoll.WaitingForInput
        sender = pair.prefill.sender(1)
        await sender.wait_ready(5)
        with pytest.raises(LocalProtocolError, match="before init"):
            await sender.send([0])
        sender.init(2)
        with pytest.raises(InvalidArgument, match="overruns num_pages=2"):
            await sender.send([0, 1, 2])
        await sender.send([3, 4])
        assert await receiver.wait(5) == KVPoll.Success
        with pytest.raises(LocalProtocolError, match="already exists"):
            pair.prefill.sender(1)
        with pytest.raises(InvalidArgument, match="room must be"):
            pair.prefill.sender(-1)
        with pytest.raises(LocalProtocolError, match="prefill manager"):
            pair.prefill.receiver(pair.addr, 2)


async def test_page_count_mismatch_fails_both_sides_with_a_reason() -> None:
    async with make_pair() as pair:
        receiver = pair.decode.receiver(pair.addr, 4)
        await receiver.init([1, 2, 3])
        sender = pair.prefill.sender(4)
        await sender.wait_ready(5)
        sender.init(2)
        assert await sender.wait(5) == KVPoll.Failed
        assert "decode expects 3 pages, prefill will send 2" in (sender.failure_reason or "")
        assert await receiver.wait(5) == KVPoll.Failed
        assert "decode expects 3 pages" in (receiver.failure_reason or "")


async def test_wait_cancellation_does_not_abort_the_room() -> None:
    async with make_pair() as pair:
        receiver = pair.decode.receiver(pair.addr, 8)
        await receiver.init([0])
        waiter = asyncio.create_task(receiver.wait())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert receiver.poll() == KVPoll.WaitingForInput
        sender = pair.prefill.sender(8)
        await sender.wait_ready(5)
        sender.init(1)
        await sender.send([0])
        assert await receiver.wait(5) == KVPoll.Success
        with pytest.raises(TimeoutError):
            await pair.prefill.sender(99).wait(timeout=0.01)


async def test_closing_a_manager_fails_its_unfinished_rooms() -> None:
    async with make_pair() as pair:
        sender = pair.prefill.sender(11)
        receiver = pair.decode.receiver(pair.addr, 12)
        await pair.prefill.close()
        assert await sender.wait(1) == KVPoll.Failed and "manager closed" in (sender.failure_reason or "")
        await pair.decode.close()
        assert await receiver.wait(1) == KVPoll.Failed
        pair.assert_no_room_state()


async def test_in_flight_bytes_are_bounded_and_send_waits() -> None:
    from asynckv.testing import FaultInjector, inject

    page = 4 * 256
    async with make_pair(entries=4, item=256, max_inflight_bytes=2 * page) as pair:
        assert await transfer_room(pair, 1, [0], [0]) == (KVPoll.Success, KVPoll.Success)  # first contact
        injector = FaultInjector()
        inject(pair.prefill, injector)
        injector.delay_posts(0.05)  # each post holds its bytes for 50 ms
        seen: list[int] = []

        async def sample() -> None:
            while True:
                seen.append(pair.prefill.room_counts()["inflight_bytes"])
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        results = await asyncio.gather(*(transfer_room(pair, 10 + i, [2 * i, 2 * i + 1], [2 * i, 2 * i + 1])
                                         for i in range(4)))
        sampler.cancel()
        assert results == [(KVPoll.Success, KVPoll.Success)] * 4
        assert max(seen) <= 2 * page and max(seen) > 0
        assert pair.prefill.room_counts()["inflight_bytes"] == 0


async def test_posts_queued_behind_a_busy_engine_move_merged_and_land_byte_exact() -> None:
    """Rooms whose posts queue while the write lane is busy (here held by a call): the engine moves
    them as merged handles (``asynckv.transport.merging``), and every page still lands where its
    room asked, over real NIXL."""
    async with make_pair(entries=2, pages=256, item=128, xfer_handle_bytes=1 << 20) as pair:
        lane = cast(LanedDataPlane, pair.prefill.data_plane).lanes[0]  # (small posts go to lane 0)
        assert lane.merge_limits == (1 << 20, Config().max_descs_per_xfer)  # (the fence's bound on one handle)
        gate = threading.Event()
        held = asyncio.ensure_future(lane.call(lambda agent: gate.wait(10)))
        rng = np.random.default_rng(3)
        src_all, dst_all = np.arange(256).reshape(32, 8), rng.permutation(256).reshape(32, 8)
        rooms = asyncio.gather(*(transfer_room(pair, 500 + i, src_all[i], dst_all[i]) for i in range(32)))
        for _ in range(1000):  # until every room's post waits behind the call
            if pair.prefill.stats.get("kv_posts", 0) >= 32:
                break
            await asyncio.sleep(0.01)
        gate.set()
        await held
        assert await rooms == [(KVPoll.Success, KVPoll.Success)] * 32
        for i in range(32):
            assert verify_pages(pair.dpool, 500 + i, dst_all[i]) == 0
        assert lane.merged >= MERGE_MIN_POSTS
        pair.assert_no_room_state()
