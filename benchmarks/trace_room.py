"""Where a room's time goes: the timeline of a 1-page room (or ``--pages N``), stage by stage.

Both managers in one process, as in Q2 (``bench_small``); one room at a time. Each stage is a
timestamp taken where the code passes a named point (a wrapper around the method, installed for
this run only), and the table gives, per stage, the median time since ``receiver.init()`` was
called and the median gap since the stage before. The wrappers add a few microseconds per
stage, so the total is a little above Q2's. This is a diagnostic, not a speed claim: it shows
which hand-off (control message, engine thread, loop wake-up) a change should aim at. The
control stages are those of the ZMQ channel (``control_transport="zmq"``), which this trace was
written for; the stream channel's cost per message is in ``bench_control.py``.

A large room is split over the write lanes: "took the post" and "transfer() returned" are the
first lane's, "the last lane" stages the last one's. ``--interleave`` puts between rooms what
Q1 (``bench_throughput``) puts there, a raw NIXL write of the same pages and a fill of the
source pages, and times that raw write as the same-run baseline: Q1's one-request ratio at
16 MiB depends on the memory state this leaves.
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
from asynckv.testing import fill_pages, verify_pages
from asynckv.transport import control as control_mod
from asynckv.transport import lanes as lanes_mod
from asynckv.transport import steer as steer_mod
from asynckv.transport import stream as stream_mod
from asynckv.transport import stream_conns
from asynckv.transport.nixl import NixlDataPlane
from asynckv.transport.nixl_engine import NixlEngine

from ._common import write_result
from ._pairs import RawNixl, pair

ITEM = 32 * 1024

STAGES = [
    ("start", "decode: receiver created, init() called"),
    ("ti_send", "decode: TransferInfo given to the control channel"),
    ("ti_zmq", "decode: TransferInfo handed to the socket (ZMQ's, or the TCP transport)"),
    ("ti_readable", "prefill: control socket readable (loop woke)"),
    ("ti_recv", "prefill: TransferInfo read from the socket"),
    ("ti_decoded", "prefill: TransferInfo decoded"),
    ("ti_handled", "prefill: core handled it (sender ready)"),
    ("build", "prefill: send() reached the write builder"),
    ("post", "prefill: descriptors built, posted to a lane"),
    ("engine", "engine thread: took the post"),
    ("engine_last", "engine threads: the last lane took its part"),
    ("copied", "engine thread: transfer() returned (bytes copied)"),
    ("copied_last", "engine threads: the last lane's transfer() returned"),
    ("settled", "prefill loop: settle taken from the engine"),
    ("settled_last", "prefill loop: the last lane's settle taken"),
    ("st_send", "prefill: Status given to the control channel"),
    ("st_zmq", "prefill: Status handed to the socket"),
    ("st_readable", "decode: control socket readable (loop woke)"),
    ("st_decoded", "decode: Status decoded"),
    ("st_handled", "decode: core handled it (room done)"),
    ("end", "decode: receiver.wait() returned"),
]


class _Trace:
    """First time each stage is passed in the current room."""

    def __init__(self, transport: str = "zmq") -> None:
        self.transport = transport
        self.marks: dict[str, float] = {}
        self.roles: dict[int, str] = {}  # id(control channel) -> "prefill" / "decode"
        self._undo: list[Callable[[], None]] = []

    def mark(self, stage: str) -> None:
        self.marks.setdefault(stage, time.perf_counter())

    def mark_last(self, stage: str) -> None:
        self.marks[stage] = time.perf_counter()

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

        if self.transport == "zmq":
            channel: Any = control_mod.ControlChannel
            self.wrap(control_mod, "_send_now", after=handed)
            self.wrap(channel, "_on_readable", before=by_role("ti_readable", "st_readable"))
        else:
            channel = stream_mod.StreamChannel
            self.wrap(stream_conns.Outbound, "send", after=handed)
            self.wrap(stream_conns.Inbound, "data_received",
                      before=lambda conn, *_: by_role("ti_readable", "st_readable")(conn._ch))
        self.wrap(channel, "send", before=send)
        self.wrap(channel, "_handle", before=lambda ch, *_: "ti_recv" if roles.get(id(ch)) == "prefill" else None)
        self.wrap(manager_mod.KVManager, "_on_message", before=by_mgr("ti_decoded", "st_decoded"),
                  after=by_mgr("ti_handled", "st_handled"))
        self.wrap(WriteBuilder, "build", before=lambda *_: "build")
        self.wrap(NixlDataPlane, "post", before=lambda *_: "post")
        self.wrap(NixlEngine, "_start", before=self._last("engine"), after=self._last("copied"))
        self.wrap(NixlDataPlane, "_on_loop", before=self._last("settled"))

    def _last(self, stage: str) -> Callable[..., None]:
        """Marks ``stage`` the first time and ``stage_last`` every time (first, so never before it)."""
        def both(*_: Any) -> None:
            self.mark(stage)
            self.mark_last(f"{stage}_last")
        return both

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


async def measure(rooms: int, pages: int = 1, interleave: bool = False, lanes: int | None = None,
                  transport: str = "zmq") -> tuple[list[dict[str, object]], float, float | None]:
    trace = _Trace(transport)
    trace.install()  # (before the managers start: some hooks are bound then)
    timelines: list[dict[str, float]] = []
    raw_s: list[float] = []
    try:
        lane_cfg = {} if lanes is None else {"write_lanes": lanes}
        async with pair(2, max(64, 2 * pages), ITEM, control_transport=transport, **lane_cfg) as (p, d):
            trace.roles.update({id(p._control): "prefill", id(d._control): "decode"})
            src, dst = np.arange(pages), np.arange(pages) + max(20, pages)
            ppool, dpool = p._bench_pools  # type: ignore[attr-defined]
            raw = RawNixl(ppool, dpool) if interleave else None
            for i in range(rooms + 20):  # (the first 20 warm up)
                if raw is not None:
                    raw_s.append(raw.write(src, dst))
                    fill_pages(ppool, 1 + i, src)
                trace.marks = {}
                trace.mark("start")
                receiver = d.receiver(p.bootstrap_addr or "", 1 + i)
                await receiver.init(dst)
                sender = p.sender(1 + i)
                await sender.wait_ready()
                sender.init(pages)
                await sender.send(src)
                result = await receiver.wait()
                trace.mark("end")
                if result != KVPoll.Success or await sender.wait() != KVPoll.Success:
                    raise RuntimeError(f"room {1 + i} failed: {receiver.failure_reason}")
                if raw is not None and verify_pages(dpool, 1 + i, dst):
                    raise RuntimeError(f"room {1 + i}: wrong bytes landed")
                sender.clear()
                receiver.clear()
                if i >= 20:
                    timelines.append(dict(trace.marks))
            if raw is not None:
                raw.close()
    finally:
        trace.uninstall()
    rows: list[dict[str, object]] = []
    previous = "start"
    passed = [(stage, label) for stage, label in STAGES if any(stage in t for t in timelines)]
    # (in the order the stages were passed: a large room's first settle can come before its last copy)
    passed.sort(key=lambda sl: np.median([t[sl[0]] - t["start"] for t in timelines if sl[0] in t]))
    for stage, label in passed:
        seen = [t for t in timelines if stage in t and previous in t]
        if not seen:
            continue
        at = float(np.median([t[stage] - t["start"] for t in seen])) * 1e3
        gap = float(np.median([t[stage] - t[previous] for t in seen])) * 1e3
        rows.append({"stage": stage, "what": label, "at_ms": at, "gap_ms": gap, "rooms": len(seen)})
        previous = stage
    total = float(np.median([t["end"] - t["start"] for t in timelines])) * 1e3
    return rows, total, float(np.median(raw_s[20:])) * 1e3 if raw_s else None


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rooms", type=int, default=300)
    parser.add_argument("--pages", type=int, default=1, help="pages per room (64 KiB each: 256 is 16 MiB)")
    parser.add_argument("--interleave", action="store_true",
                        help="between rooms, a raw NIXL write of the same pages and a page fill, as Q1 does")
    parser.add_argument("--lanes", type=int, default=None, help="prefill's write lanes (default: Config's)")
    parser.add_argument("--transport", choices=("zmq", "stream"), default="zmq",
                        help="the control channel (zmq, which this trace was written for, or stream, the default's)")
    parser.add_argument("--relay", choices=("auto", "off", "unsteered"), default="auto",
                        help="off: a split write's parts go to their lanes from the loop, as on a host with more "
                             "cores than lanes (docs/design-decisions.md, 23); unsteered: relayed, but the woken "
                             "lane's thread may be queued on its waker's CPU (asynckv/transport/steer.py)")
    args = parser.parse_args(argv)
    if args.pages < 1:
        parser.error("--pages must be at least 1")
    print(f"Room trace: where a {args.pages}-page room's time goes (both managers in one process"
          f"{'; a raw NIXL write and a page fill between rooms' if args.interleave else ''}):")
    usable_cpus, steering = lanes_mod.usable_cpus, steer_mod.steering_available
    if args.relay == "off":  # (as if the host had many cores: the managers' laned planes decide at start)
        lanes_mod.usable_cpus = lambda: 1 << 20
    if args.relay == "unsteered":
        steer_mod.steering_available = lambda: False
    try:
        rows, total, raw_ms = asyncio.run(measure(args.rooms, args.pages, args.interleave, args.lanes, args.transport))
    finally:
        lanes_mod.usable_cpus = usable_cpus
        steer_mod.steering_available = steering
    for r in rows:
        print(f"  {r['at_ms']:7.3f} ms  (+{r['gap_ms']:6.3f})  {r['what']}")
    print(f"  median room {total:.3f} ms" + (f"; raw NIXL's write of the same pages {raw_ms:.3f} ms "
                                            f"({raw_ms / total:.2f}x)" if raw_ms else ""), flush=True)
    result: dict[str, object] = {"question": __doc__.strip().splitlines()[0], "rows": rows, "room_p50_ms": total,
                                 "pages": args.pages, "interleave": args.interleave, "raw_write_p50_ms": raw_ms,
                                 "write_lanes": args.lanes, "transport": args.transport, "relay": args.relay}
    name = "room_trace" if args.pages == 1 and not args.interleave and args.lanes is None else \
        f"room_trace_{args.pages}p{'_interleaved' if args.interleave else ''}" \
        f"{'' if args.lanes is None else f'_{args.lanes}lanes'}{'' if args.transport == 'zmq' else '_stream'}" \
        f"{'' if args.relay == 'auto' else '_norelay' if args.relay == 'off' else '_unsteered'}"
    write_result(name, result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
