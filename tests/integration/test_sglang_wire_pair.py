"""Two asynckv managers that both speak SGLang 0.5.10's wire (``Config(wire="sglang-0.5.10")``), in
one process over real NIXL, ZMQ and the SGLang-wire bootstrap server: what runs in every CI even
without the SGLang venv (tests/interop pairs each side with a real SGLang rank)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynckv import Aborted, KVPoll

from .conftest import check_landed, make_pair, transfer_room

pytestmark = pytest.mark.integration

WIRE = "sglang-0.5.10"


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
async def test_pages_land_byte_for_byte_over_the_sglang_wire(mla: bool) -> None:
    async with make_pair(entries=3 if mla else 4, mla=mla, wire=WIRE) as pair:
        rng = np.random.default_rng(3)
        for room in (4535838703865032264, 12):  # SGLang's rooms are random 63-bit ids
            src, dst = rng.permutation(64)[:11], rng.permutation(64)[:11]
            pair.dpool.kv[:] = 0
            assert await transfer_room(pair, room, src, dst, chunk=4, src_aux=2, dst_aux=9) == (
                KVPoll.Success, KVPoll.Success)
            check_landed(pair, room, dst, 9)
            assert not pair.dpool.kv[:, np.setdiff1d(np.arange(64), dst)].any()
        assert pair.prefill.snapshot()["peers"][0]["session"] == 1  # one registration, reused
        pair.assert_no_room_state()


async def test_a_room_aborted_on_decode_is_not_fenced_and_a_late_write_is_counted() -> None:
    """The documented limit of this wire: SGLang has no abort message, so the prefill still writes
    into an aborted room's pages; decode counts (and logs) that late notification."""
    async with make_pair(wire=WIRE) as pair:
        receiver = pair.decode.receiver(pair.addr, 5)
        sender = pair.prefill.sender(5)
        assert await receiver.init([1, 2], 0) == KVPoll.WaitingForInput
        assert await sender.wait_ready(10) == KVPoll.WaitingForInput
        assert await receiver.abort() == KVPoll.Failed
        assert isinstance(receiver.failure_exception(), Aborted)
        sender.init(2, 0)
        await sender.send(np.array([7, 8]))
        assert await sender.wait(10) == KVPoll.Success  # it never heard of the abort
        for _ in range(200):
            if pair.decode.stats.get("late_notification", 0) >= 2:  # (from two write lanes: in any order)
                break
            await asyncio.sleep(0.01)
        assert pair.decode.stats["late_notification"] == 2  # the KV chunk and the aux row
        sender.clear()
        receiver.clear()
        pair.assert_no_room_state()
