"""An asynckv prefill rank on SGLang's wire in its own process (run with asynckv's Python), for a
stock SGLang decode to receive from and for the test to kill: it starts the manager with an
embedded SGLang-wire bootstrap server, prints ``{"bootstrap": addr}``, opens the room's sender,
waits for its destination, prints ``{"ready": room}`` and then holds the room until killed.

    python asynckv_prefill.py <room> <mha|mla>
"""

from __future__ import annotations

import asyncio
import json
import sys

from asynckv import Config, KVManager, Mode
from asynckv.testing import KVPool


async def main(room: int, mla: bool) -> None:
    pool = KVPool(2 if mla else 4, 16, 256, aux_rows=8, aux_buffers=10)
    config = Config(wire="sglang-0.5.10", bootstrap_timeout_s=120.0)
    async with KVManager(Mode.PREFILL, pool.kv_args(4, is_mla=mla), bootstrap_addr="127.0.0.1:0",
                         config=config) as mgr:
        print(json.dumps({"bootstrap": mgr.bootstrap_addr}), flush=True)
        sender = mgr.sender(room)
        print(json.dumps({"ready": room, "poll": (await sender.wait_ready(120)).name}), flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] == "mla"))
