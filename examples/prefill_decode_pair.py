"""Move one request's KV pages from a prefill manager to a decode manager and check them.

Both managers run in this process (two NIXL agents, DRAM, UCX over loopback); in
production each rank is its own process. Run: .venv/bin/python examples/prefill_decode_pair.py
"""

import asyncio

import numpy as np

from asynckv import KVArgs, KVManager, KVPoll, Mode

LAYERS, PAGES, PAGE_BYTES = 4, 32, 4096  # per K or V buffer of one layer


async def main() -> None:
    prefill_kv = np.random.default_rng(0).integers(0, 255, (2 * LAYERS, PAGES, PAGE_BYTES), dtype=np.uint8)
    decode_kv = np.zeros_like(prefill_kv)
    prefill_args = KVArgs.from_arrays(prefill_kv, page_size=16)  # entry axis first, then pages
    decode_args = KVArgs.from_arrays(decode_kv, page_size=16)

    async with KVManager(Mode.PREFILL, prefill_args, bootstrap_addr="127.0.0.1:0") as prefill, \
            KVManager(Mode.DECODE, decode_args) as decode:
        room = 42
        receiver = decode.receiver(prefill.bootstrap_addr or "", room)
        await receiver.init(page_indices=[9, 3, 17, 4])  # pages decode pre-allocated
        sender = prefill.sender(room)
        await sender.wait_ready()
        sender.init(num_pages=4)
        await sender.send([0, 1])  # chunked prefill: first chunk
        await sender.send([2, 3])  # the chunk that reaches num_pages is the last
        assert await receiver.wait() == KVPoll.Success
        assert np.array_equal(decode_kv[:, [9, 3, 17, 4]], prefill_kv[:, [0, 1, 2, 3]])
        print("4 pages x", 2 * LAYERS, "buffers landed:", await sender.wait())
        sender.clear()
        receiver.clear()


if __name__ == "__main__":
    asyncio.run(main())
