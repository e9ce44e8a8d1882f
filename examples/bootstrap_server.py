"""Run a standalone bootstrap server for 2 seconds and show its /health answer.

Equivalent to `asynckv bootstrap-server --port 8998` without the waiting.
"""

import asyncio

import aiohttp

from asynckv import BootstrapServer


async def main() -> None:
    async with BootstrapServer("127.0.0.1", 0) as server, aiohttp.ClientSession() as http:
        async with http.get(f"http://{server.addr}/health") as resp:
            print(resp.status, await resp.json())


if __name__ == "__main__":
    asyncio.run(main())
