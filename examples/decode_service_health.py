"""An aiohttp decode service that exposes asynckv's health and metrics next to its own routes.

The service owns a decode KVManager; its /health answers 503 as soon as asynckv's reader,
engine thread or heartbeats stop (what an orchestrator's liveness probe should watch), and
/metrics serves asynckv's Prometheus series. Runs for a moment and prints what it serves.
"""

import asyncio

import aiohttp
import numpy as np
from aiohttp import web

from asynckv import KVArgs, KVManager, Mode
from asynckv.service.ops import add_ops_routes


async def main() -> None:
    kv = np.zeros((8, 64, 4096), dtype=np.uint8)
    async with KVManager(Mode.DECODE, KVArgs.from_arrays(kv, page_size=16)) as manager:

        async def health(request: web.Request) -> web.Response:
            ok = manager.healthy
            return web.json_response({"status": "ok" if ok else "failing"}, status=200 if ok else 503)

        app = web.Application()
        app.router.add_get("/health", health)
        add_ops_routes(app)  # /metrics and /peers
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                print("/health", resp.status, await resp.json())
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                lines = [line for line in (await resp.text()).splitlines() if line.startswith("asynckv_manager")]
                print("/metrics", resp.status, lines)
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
