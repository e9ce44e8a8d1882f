"""Where a small room's time goes: the timeline of a 1-page room, stage by stage.

Both managers in one process, as in Q2 (``bench_small``); one room at a time. Each stage is a
timestamp taken where the code passes a named point (a wrapper around the method, installed for
this run only), and the table gives, per stage, the median time since ``receiver.init()`` was
called and the median gap since the stage before. The wrappers add a few microseconds per
stage, so the total is a little above Q2's. This is a diagnostic, not a speed claim: it shows
which hand-off (control message, engine thread, loop wake-up) a change should aim at. The
control stages are those of the ZMQ channel (``control_transport="zmq"``), which this trace was
written for; the stream channel's cost per message is in ``bench_control.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asynckv import KVPoll
from asynckv.proto.messages import Status, TransferInfo
from asynckv.service import manager as manager_mod
from asynckv.service.writes import WriteBuilder
from asynckv.transport import control as control_mod
from asynckv.transport.nixl import NixlDataPlane
from asynckv.transport.nixl_engine import NixlEngine

from ._common import write_result
from ._pairs import pair

ITEM = 32 * 1024

STAGES = [
    ("start", "decode: receiver created, init() called"),
    ("ti_send", "decode: TransferInfo given to the control channel"),
    ("ti_zmq", "decode: TransferInfo handed to ZMQ"),
    ("ti_readable", "prefill: control socket readable (loop woke)"),
    ("ti_recv", "prefill: TransferInfo received from ZMQ"),
    ("ti_decoded", "prefill: TransferInfo decoded"),
    ("ti_handled", "prefill: core handled it (sender ready)"),
    ("build", "prefill: send() reached the write builder"),
    ("post", "prefill: descriptors built, posted to a lane"),
    ("engine", "engine thread: took the post"),
    ("copied", "engine thread: transfer() returned (bytes copied)"),
    ("settled", "prefill loop: settle taken from the engine"),
    ("st_send", "prefill: Status given to the control channel"),
    ("st_zmq", "prefill: Status handed to ZMQ"),
    ("st_readable", "decode: control socket readable (loop woke)"),
    ("st_decoded", "decode: Status decoded"),
    ("st_handled", "decode: core handled it (room done)"),
    ("end", "decode: receiver.wait() returned"),
]


class _Trace:
    """First time each stage is passed in the current room."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.roles: dict[int, str] = {}  # id(control channel) -> "prefill" / "decode"
        self._undo: list[Callable[[], None]] = []

    def mark(self, stage: str) -> None:
        self.marks.setdefault(stage, time.perf_counter())

    def wrap(self, owner: Any, name: str, before: Callable[..., str | None] | None = None,
             after: Callable[..., str | None] | None = None) -> None:
        """Wrap ``owner.name``; ``before``/``after`` get the call's arguments and name the stage to
        mark (or None). A missing method fails here, so the smoke test catches a renamed hook."""
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None and (stage := before(*args)) is not None:
                self.mark(stage)
            result = original(*args, **kwargs)
            if after is not None and (stage := after(*args)) is not None:
                self.mark(stage)
            return result

        setattr(owner, name, wrapper)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        roles = self.roles
        sending: dict[str, Any] = {}

        def send(ch: Any, endpoint: str, msg: Any, *_: Any) -> str | None:
            sending["msg"] = msg
            return {TransferInfo: "ti_send", Status: "st_send"}.get(type(msg))

        def handed(*_: Any) -> str | None:
            return {TransferInfo: "ti_zmq", Status: "st_zmq"}.get(type(sending.get("msg")))

        def by_role(prefill: str, decode: str) -> Callable[..., str | None]:
            return lambda ch, *_: prefill if roles.get(id(ch)) == "prefill" else decode

        def by_mgr(prefill: str, decode: str) -> Callable[..., str | None]:
            return lambda mgr, *_: prefill if mgr.mode.value == "prefill" else decode

        channel = control_mod.ControlChannel
        self.wrap(channel, "send", before=send)
        self.wrap(control_mod, "_send_now", after=handed)
        self.wrap(channel, "_on_readable", before=by_role("ti_readable", "st_readable"))
        self.wrap(channel, "_handle", before=lambda ch, *_: "ti_recv" if roles.get(id(ch)) == "prefill" else None)
        self.wrap(manager_mod.KVManager, "_on_message", before=by_mgr("ti_decoded", "st_decoded"),
                  after=by_mgr("ti_handled", "st_handled"))
        self.wrap(WriteBuilder, "build", before=lambda *_: "build")
        self.wrap(NixlDataPlane, "post", before=lambda *_: "post")
        self.wrap(NixlEngine, "_start", before=lambda *_: "engine", after=lambda *_: "copied")
        self.wrap(NixlDataPlane, "_on_loop", before=lambda *_: "settled")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


async def measure(rooms: int) -> tuple[list[dict[str, object]], float]:
    trace = _Trace()
    trace.install()  # (before the managers start: some hooks are bound then)
    timelines: list[dict[str, float]] = []
    try:
        async with pair(2, 64, ITEM, control_transport="zmq") as (p, d):
            trace.roles.update({id(p._control): "prefill", id(d._control): "decode"})
            src, dst = np.arange(1), np.arange(1) + 20
            for i in range(rooms + 20):  # (the first 20 warm up)
                trace.marks = {}
                trace.mark("start")
                receiver = d.receiver(p.bootstrap_addr or "", 1 + i)
                await receiver.init(dst)
                sender = p.sender(1 + i)
                await sender.wait_ready()
                sender.init(1)
                await sender.send(src)
                result = await receiver.wait()
                trace.mark("end")
                if result != KVPoll.Success or await sender.wait() != KVPoll.Success:
                    raise RuntimeError(f"room {1 + i} failed: {receiver.failure_reason}")
                sender.clear()
                receiver.clear()
                if i >= 20:
                    timelines.append(dict(trace.marks))
    finally:
        trace.uninstall()
    rows: list[dict[str, object]] = []
    previous = "start"
    for stage, label in STAGES:
        seen = [t for t in timelines if stage in t and previous in t]
        if not seen:
            continue
        at = float(np.median([t[stage] - t["start"] for t in seen])) * 1e3
        gap = float(np.median([t[stage] - t[previous] for t in seen])) * 1e3
        rows.append({"stage": stage, "what": label, "at_ms": at, "gap_ms": gap, "rooms": len(seen)})
        previous = stage
    total = float(np.median([t["end"] - t["start"] for t in timelines])) * 1e3
    return rows, total


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rooms", type=int, default=300)
    args = parser.parse_args(argv)
    print("Room trace: where a 1-page room's time goes (both managers in one process):")
    rows, total = asyncio.run(measure(args.rooms))
    for r in rows:
        print(f"  {r['at_ms']:7.3f} ms  (+{r['gap_ms']:6.3f})  {r['what']}")
    print(f"  median room {total:.3f} ms", flush=True)
    result: dict[str, object] = {"question": __doc__.strip().splitlines()[0], "rows": rows, "room_p50_ms": total}
    write_result("room_trace", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
