"""Run a prefill or decode rank in a child process that a test can SIGKILL or SIGSTOP.

The child is the demo worker (``python -m asynckv _worker ROLE SPEC``): a prefill serves,
or a decode receives, the request stream of a ``DemoSpec`` (rooms and page counts from its
seed), filling or verifying every page. Drive the other side from the test with the
same spec and ``asynckv.testing.workload``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..demo import DemoSpec

__all__ = ["PeerProcess"]


class PeerProcess:
    """A demo worker child process."""

    def __init__(self, role: str, proc: asyncio.subprocess.Process) -> None:
        self.role = role
        self.proc = proc

    @classmethod
    async def start(cls, role: str, spec: DemoSpec, env: dict[str, str] | None = None) -> PeerProcess:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "asynckv", "_worker", role, json.dumps(dataclasses.asdict(spec)),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        return cls(role, proc)

    @classmethod
    def start_ctx(cls, role: str, spec: DemoSpec, env: dict[str, str] | None = None) -> _Starting:
        """``async with PeerProcess.start_ctx(role, spec) as proc:`` kills it on exit if still running."""
        return _Starting(cls.start(role, spec, env))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the process dies at once, its sockets close, NIXL sees a disconnect."""
        self.proc.send_signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGSTOP: the process freezes; peers see silence, never an error."""
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    async def wait(self, timeout: float | None = None) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def output(self) -> str:
        """Everything the child printed (after it exited)."""
        out = await self.proc.stdout.read() if self.proc.stdout else b""
        err = await self.proc.stderr.read() if self.proc.stderr else b""
        return (out + err).decode(errors="replace")

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.cont()
            self.kill()
            await self.proc.wait()

    async def __aenter__(self) -> PeerProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Starting:
    def __init__(self, starting: Any) -> None:
        self._starting = starting
        self._proc: PeerProcess | None = None

    async def __aenter__(self) -> PeerProcess:
        self._proc = await self._starting
        return self._proc

    async def __aexit__(self, *exc: object) -> None:
        if self._proc is not None:
            await self._proc.close()
