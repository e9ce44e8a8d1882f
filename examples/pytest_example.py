"""How to test your serving stack's KV hand-off with pytest-asyncio and asynckv.testing.

Run as a script (it runs pytest on itself) or collect it with your own pytest.
"""

import sys
from collections.abc import AsyncIterator

import pytest

from asynckv import Config, KVManager, KVPoll, KVReceiver, Mode
from asynckv.testing import FaultInjector, KVPool, fill_pages, inject, verify_pages

Pair = tuple[KVManager, KVManager, KVPool, KVPool]  # the prefill and decode managers, and their pools


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    prefill_pool, decode_pool = KVPool(4, 32, 256), KVPool(4, 32, 256)
    cfg = Config(waiting_timeout_s=10)
    async with KVManager(Mode.PREFILL, prefill_pool.kv_args(4), bootstrap_addr="127.0.0.1:0", config=cfg) as p, \
            KVManager(Mode.DECODE, decode_pool.kv_args(4), config=cfg) as d:
        yield p, d, prefill_pool, decode_pool


async def hand_off(p: KVManager, d: KVManager, room: int, src: list[int], dst: list[int]) -> KVReceiver:
    assert p.bootstrap_addr is not None  # (a PREFILL manager always has one)
    receiver = d.receiver(p.bootstrap_addr, room)
    await receiver.init(dst)
    sender = p.sender(room)
    await sender.wait_ready()
    sender.init(len(src))
    await sender.send(src)
    return receiver


@pytest.mark.asyncio
async def test_pages_arrive(pair: Pair) -> None:
    p, d, prefill_pool, decode_pool = pair
    fill_pages(prefill_pool, room=7, pages=[0, 1, 2])
    receiver = await hand_off(p, d, 7, [0, 1, 2], [9, 4, 5])
    assert await receiver.wait() == KVPoll.Success
    assert verify_pages(decode_pool, room=7, pages=[9, 4, 5]) == 0


@pytest.mark.asyncio
async def test_a_failing_transfer_is_reported_not_hung(pair: Pair) -> None:
    p, d, _, _ = pair
    assert await (await hand_off(p, d, 7, [0], [0])).wait() == KVPoll.Success  # peers connected
    injector = FaultInjector()
    inject(p, injector)
    injector.fail_next(1)  # the next data-plane post fails
    receiver = await hand_off(p, d, 8, [0], [0])
    assert await receiver.wait() == KVPoll.Failed
    assert receiver.failure_reason is not None
    assert "injected failure" in receiver.failure_reason


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto",
                          "-W", "ignore::pytest.PytestAssertRewriteWarning"]))
