"""Decode staging with real NIXL and real control: two TP2 prefill ranks write whole pages into a TP1
decode's staging slots, and decode copies their heads into its pages. Bytes are checked token row by
token row; an aborted room's pages are never written at all, and its slots wait for its fence."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from prometheus_client import generate_latest

from asynckv import BootstrapServer, Config, KVManager, KVPoll, KVReceiver, KVSender, Mode
from asynckv.service.decode_staging import DecodeStaging
from asynckv.service.metrics import REGISTRY
from asynckv.testing import FaultInjector, KVPool, fill_pages, inject

from .conftest import CONTROL

pytestmark = pytest.mark.integration

PAGE, HEADS, HEAD_BYTES, PAGES = 4, 4, 16, 16
ITEM = PAGE * HEADS * HEAD_BYTES
"""A decode page of one entry: 4 tokens x 4 heads x 16 bytes; each TP2 prefill rank holds 2 of the heads."""


@contextlib.asynccontextmanager
async def tp2_to_tp1(staging_bytes: int) -> AsyncIterator[tuple[list[KVManager], KVManager, list[KVPool], KVPool, str]]:
    cfg = Config(**CONTROL, host_bootstrap=False, waiting_timeout_s=20, decode_staging_bytes=staging_bytes)
    async with BootstrapServer("127.0.0.1", 0) as server, contextlib.AsyncExitStack() as stack:
        dpool = KVPool(2, PAGES, ITEM, aux_rows=4)
        ppools = [KVPool(2, PAGES, ITEM // 2, aux_rows=4) for _ in range(2)]
        prefill = [await stack.enter_async_context(KVManager(
            Mode.PREFILL, ppools[r].kv_args(PAGE, tp_size=2, engine_rank=r, kv_head_num=HEADS // 2,
                                            total_kv_head_num=HEADS), bootstrap_addr=server.addr, config=cfg))
            for r in range(2)]
        decode = await stack.enter_async_context(KVManager(
            Mode.DECODE, dpool.kv_args(PAGE, kv_head_num=HEADS, total_kv_head_num=HEADS), config=cfg))
        yield prefill, decode, ppools, dpool, server.addr


def staging_of(decode: KVManager) -> DecodeStaging:
    staging = decode._svc.staging  # type: ignore[union-attr]
    assert isinstance(staging, DecodeStaging)
    return staging


async def start_room(prefill: list[KVManager], decode: KVManager, addr: str, room: int, src: list[int],
                     dst: list[int]) -> tuple[KVReceiver, list[KVSender]]:
    receiver = decode.receiver(addr, room)
    await receiver.init(dst)
    senders = [p.sender(room) for p in prefill]
    for s in senders:
        await s.wait_ready(5)
        s.init(len(src))
        await s.send(src)
    return receiver, senders


def expected_rows(ppools: list[KVPool], src: list[int]) -> np.ndarray:
    """Decode's token rows for ``src``: each prefill rank's rows side by side, rank 0's heads first."""
    parts = [p.kv[:, src].view(np.uint8).reshape(2, len(src), PAGE, ITEM // PAGE // len(ppools)) for p in ppools]
    return np.concatenate(parts, axis=3)


def rows(dpool: KVPool, dst: list[int]) -> np.ndarray:
    return dpool.kv[:, dst].view(np.uint8).reshape(2, len(dst), PAGE, ITEM // PAGE)


async def test_staged_rooms_land_each_ranks_heads_in_place_in_chunks_and_in_parallel() -> None:
    async with tp2_to_tp1(2 * 2**20) as (prefill, decode, ppools, dpool, addr):
        assert staging_of(decode).slots == 0  # shaped by the first prefill TP it registers with
        rooms = [(1, [0, 1, 2], [9, 4, 5]), (2, [5, 6], [0, 15]), (3, [7, 8, 9, 10], [10, 11, 12, 13])]
        for room, src, _ in rooms:
            for r, pool in enumerate(ppools):
                fill_pages(pool, room * 10 + r, src)
        started = [await start_room(prefill, decode, addr, room, src, dst) for room, src, dst in rooms]
        for (receiver, senders), (room, src, dst) in zip(started, rooms, strict=True):
            assert await receiver.wait(10) == KVPoll.Success, receiver.failure_reason
            assert [await s.wait(10) for s in senders] == [KVPoll.Success] * 2
            assert np.array_equal(rows(dpool, dst), expected_rows(ppools, src)), f"room {room}"
        untouched = sorted(set(range(PAGES)) - {p for *_, dst in rooms for p in dst})
        assert not dpool.kv[:, untouched].any()
        staging = staging_of(decode)
        assert staging.slots == 2 * 2**20 // (2 * ITEM // 2) and staging.free_slots == staging.slots


async def test_an_aborted_staged_room_writes_nothing_into_its_pages_and_frees_its_slots_once_fenced() -> None:
    async with tp2_to_tp1(2 * 2**20) as (prefill, decode, ppools, dpool, addr):
        staging = staging_of(decode)
        receiver, senders = await start_room(prefill, decode, addr, 1, [0], [0])  # first contact
        assert await receiver.wait(10) == KVPoll.Success
        injector = FaultInjector()
        inject(prefill[0], injector)
        injector.delay_posts(0.3)  # rank 0's write lands 0.3 s after it is posted
        for r, pool in enumerate(ppools):
            fill_pages(pool, 20 + r, [3, 4])
        dpool.kv[:] = 0
        receiver, senders = await start_room(prefill, decode, addr, 2, [3, 4], [6, 7])
        await asyncio.sleep(0.05)
        assert staging.free_slots == staging.slots - 4
        assert await receiver.abort("gave up") == KVPoll.Failed
        assert staging.free_slots == staging.slots  # fenced (rank 0 cancelled its write): the slots are free
        await asyncio.sleep(0.4)
        assert not dpool.kv.any()  # the write went into staging; nothing was copied out
        inject(prefill[0], None)
        for s in senders:
            s.clear()
        receiver.clear()
        for r, pool in enumerate(ppools):
            fill_pages(pool, 30 + r, [5])
        receiver, senders = await start_room(prefill, decode, addr, 3, [5], [6])
        assert await receiver.wait(10) == KVPoll.Success
        assert np.array_equal(rows(dpool, [6]), expected_rows(ppools, [5]))
        assert staging.free_slots == staging.slots


async def test_rooms_queue_for_a_small_area_and_one_larger_than_it_fails_naming_the_setting() -> None:
    async with tp2_to_tp1(4 * ITEM) as (prefill, decode, ppools, dpool, addr):  # 4 slots: 2 pages a room
        staging = staging_of(decode)
        for r, pool in enumerate(ppools):
            fill_pages(pool, 40 + r, list(range(8)))
        receivers = []
        for room in range(1, 5):  # each takes the whole area: they go one after the other
            receiver = decode.receiver(addr, room)
            receiver.init_nowait([2 * room, 2 * room + 1])  # (init() would wait for the room's turn)
            receivers.append(receiver)
        for _ in range(500):  # (registration first: then room 1 holds the area and the rest wait)
            if staging_gauges(decode) == (4 * ITEM, 4 * ITEM, 3.0):
                break
            await asyncio.sleep(0.01)
        assert staging_gauges(decode) == (4 * ITEM, 4 * ITEM, 3.0)  # (the whole area)

        async def serve(p: KVManager) -> None:
            for room in range(1, 5):
                s = p.sender(room)
                await s.wait_ready(10)
                s.init(2)
                await s.send([2 * room - 2, 2 * room - 1])
                assert await s.wait(10) == KVPoll.Success
                s.clear()

        await asyncio.gather(*(serve(p) for p in prefill))
        assert [await r.wait(10) for r in receivers] == [KVPoll.Success] * 4
        assert staging.slots == 4
        for room in range(1, 5):
            assert np.array_equal(rows(dpool, [2 * room, 2 * room + 1]),
                                  expected_rows(ppools, [2 * room - 2, 2 * room - 1]))
        big = decode.receiver(addr, 9)
        assert await big.init([0, 1, 2]) == KVPoll.Failed and "decode_staging_bytes" in (big.failure_reason or "")
        assert staging.free_slots == staging.slots
        assert staging_gauges(decode) == (4 * ITEM, 0.0, 0.0)


def staging_gauges(decode: KVManager) -> tuple[float, float, float]:
    """What ``/metrics`` says of the decode's staging area: capacity and held bytes, rooms waiting for slots."""
    text = generate_latest(REGISTRY).decode()
    me = f'manager="{decode.name[:8]}"'
    values = {line.split("{")[0] + ("/" + line.split('use="')[1].split('"')[0] if "use=" in line else ""):
              float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if me in line and "staging" in line}
    return (values["asynckv_staging_bytes/capacity"], values["asynckv_staging_bytes/held"],
            values["asynckv_staging_waiting_rooms"])


async def test_a_failing_copy_fails_the_room_only_once_every_copy_of_it_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's slice is copied on its own worker thread: one raising fails the room, with its reason,
    but only once the other copy, still writing the room's pages, has ended."""
    import threading
    import time

    from asynckv.service import decode as decode_service
    monkeypatch.setattr(decode_service, "SCATTER_INLINE_BYTES", 0)  # every copy on the worker threads
    calls, ended, lock = [], [], threading.Lock()
    real = DecodeStaging.scatter

    def scatter(self: DecodeStaging, pages: np.ndarray, slices: tuple[object, ...]) -> int:
        with lock:
            calls.append(len(slices))
            first = len(calls) == 1
        if first:
            raise RuntimeError("copy boom")
        time.sleep(0.2)
        n = real(self, pages, slices)  # type: ignore[arg-type]
        ended.append(time.monotonic())
        return n
    monkeypatch.setattr(DecodeStaging, "scatter", scatter)
    async with tp2_to_tp1(2 * 2**20) as (prefill, decode, _, _, addr):
        receiver, senders = await start_room(prefill, decode, addr, 1, [0, 1], [2, 3])
        assert await receiver.wait(10) == KVPoll.Failed
        assert ended and calls == [1, 1]  # one slice per copy, and the slow one had ended
        assert "copy boom" in (receiver.failure_reason or "")
        assert [await s.wait(5) for s in senders] == [KVPoll.Success] * 2
        receiver.clear()
        staging = staging_of(decode)
        assert staging.free_slots == staging.slots


@pytest.mark.parametrize("first_tp", [2, 4])
async def test_a_tp2_and_a_tp4_prefill_share_the_slots_whichever_registers_first(first_tp: int) -> None:
    """A TP1 decode fed by a TP2 prefill (two heads a rank) and a TP4 one (a head a rank): slots hold half
    a page (two heads) whichever registers first; the TP4 ranks register the area as quarter pages, two
    to a slot, so its rooms take as many slots as the TP2's. Rooms of both in flight at once land byte
    for byte."""
    cfg = Config(**CONTROL, host_bootstrap=False, waiting_timeout_s=20, decode_staging_bytes=16 * ITEM)
    async with BootstrapServer("127.0.0.1", 0) as s2, BootstrapServer("127.0.0.1", 0) as s4, \
            contextlib.AsyncExitStack() as stack:
        dpool = KVPool(2, PAGES, ITEM, aux_rows=4)
        groups = []
        for tp, server in ((2, s2), (4, s4)):
            pools = [KVPool(2, PAGES, ITEM // tp, aux_rows=4) for _ in range(tp)]
            managers = [await stack.enter_async_context(KVManager(
                Mode.PREFILL, pools[r].kv_args(PAGE, tp_size=tp, engine_rank=r, kv_head_num=HEADS // tp,
                                               total_kv_head_num=HEADS), bootstrap_addr=server.addr, config=cfg))
                for r in range(tp)]
            groups.append((managers, pools, server.addr))
        decode = await stack.enter_async_context(KVManager(
            Mode.DECODE, dpool.kv_args(PAGE, kv_head_num=HEADS, total_kv_head_num=HEADS), config=cfg))
        staging = staging_of(decode)
        first = groups[first_tp // 4]
        receiver, _ = await start_room(first[0], decode, first[2], 1, [0, 1], [2, 3])  # (it shapes the area)
        assert await receiver.wait(10) == KVPoll.Success
        assert staging.tp_prefill == first_tp and staging.slots == 16 and staging.per_slot(4) == 2
        rooms = [(10, 1, [3, 4, 5], [9, 0, 1]), (11, 0, [6, 7], [12, 13]), (12, 1, [8, 9], [14, 6])]
        for room, g, src, _ in rooms:
            for r, pool in enumerate(groups[g][1]):
                fill_pages(pool, room * 10 + r, src)
        started = [await start_room(groups[g][0], decode, groups[g][2], room, src, dst) for room, g, src, dst in rooms]
        regs = decode._svc.core.registrations  # type: ignore[union-attr]
        assert all(regs[m.name].staged for g in groups for m in g[0])
        for (receiver, senders), (room, g, src, dst) in zip(started, rooms, strict=True):
            assert await receiver.wait(10) == KVPoll.Success, receiver.failure_reason
            assert [await s.wait(10) for s in senders] == [KVPoll.Success] * len(senders)
            assert np.array_equal(rows(dpool, dst), expected_rows(groups[g][1], src)), f"room {room}"
        assert staging.free_slots == staging.slots
