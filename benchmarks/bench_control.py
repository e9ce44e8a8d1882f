"""What one control message costs on ZMQ against a plain TCP stream read by the event loop
itself: a ping-pong of 200-byte messages (a ``Status`` is 116 bytes
on the wire, a 5-page ``TransferInfo`` 242) between two processes on uvloop, one at a time.

The ZMQ side does what ``transport/control.py`` does: a PUSH socket sends without blocking, a
PULL socket is read from a callback on its file descriptor until ``zmq.Again``. The TCP side is
an ``asyncio.Protocol`` with a 4-byte length before each message and ``TCP_NODELAY``. Reported:
round-trip p50/p90 and CPU per round trip of each process (its own threads included: ZMQ's I/O
thread does its part of every send and receive). Rounds alternate the two transports.
The same exchange then runs through asynckv's two control channels, ``StreamChannel`` (TCP, the
default) and ``ControlChannel`` (``control_transport="zmq"``), to show what each costs in full
(packing, queues, the reader's batching; design decision 18).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import cast

from ._common import write_result

MESSAGE = b"x" * 200
TRANSPORTS = ["zmq", "tcp", "zmq-channel", "stream-channel"]
"""Bare ZMQ sockets and a bare TCP stream as above; then asynckv's ``ControlChannel`` (ZMQ) and
``StreamChannel`` themselves, each message packed into a frame as asynckv's wire does."""
LENGTH = struct.Struct("<I")


async def _zmq(role: str, port_in: int, port_out: int, count: int) -> dict[str, float]:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"tcp://127.0.0.1:{port_in}")
    push.connect(f"tcp://127.0.0.1:{port_out}")
    loop = asyncio.get_running_loop()
    fd = cast(int, pull.getsockopt(zmq.FD))

    def close() -> None:
        pull.close(0)
        push.close(0)
        ctx.term()
    return await _exchange(role, count, lambda msg: push.send(msg, zmq.NOBLOCK, copy=False),
                           lambda deliver: loop.add_reader(fd, _zmq_reader(pull, deliver)), close)


def _zmq_reader(pull: object, deliver: object) -> Callable[[], None]:
    import zmq

    def read() -> None:
        while True:
            try:
                frame = pull.recv(zmq.NOBLOCK, copy=False)  # type: ignore[attr-defined]
            except zmq.Again:
                return
            deliver(frame.bytes)  # type: ignore[operator]
    return read


async def _tcp(role: str, port_in: int, port_out: int, count: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    handlers: list[object] = []

    class Reader(asyncio.Protocol):
        def __init__(self) -> None:
            self.buf = bytearray()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while len(self.buf) >= LENGTH.size:
                (n,) = LENGTH.unpack_from(self.buf)
                if len(self.buf) < LENGTH.size + n:
                    return
                msg = bytes(self.buf[LENGTH.size:LENGTH.size + n])
                del self.buf[:LENGTH.size + n]
                handlers[0](msg)  # type: ignore[operator]

    server = await loop.create_server(Reader, "127.0.0.1", port_in)
    for _ in range(100):  # (the peer's server may not listen yet)
        try:
            out, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port_out)
            break
        except OSError:
            await asyncio.sleep(0.02)
    else:
        raise RuntimeError(f"cannot connect to port {port_out}")
    out.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close() -> None:
        out.close()
        server.close()
    return await _exchange(role, count, lambda msg: out.write(LENGTH.pack(len(msg)) + msg), handlers.append, close)


async def _channel(kind: str, role: str, port_in: int, port_out: int, count: int) -> dict[str, float]:
    """asynckv's own channels (``ControlChannel``, ``StreamChannel``), messages as opaque bytes:
    they bind random ports, so each side leaves its endpoint in a file named by its port number."""
    import tempfile

    from asynckv.proto.messages import unpack
    from asynckv.transport.control import ControlChannel
    from asynckv.transport.stream import StreamChannel

    handlers: list[object] = []
    codec = (lambda frames: unpack(frames[0])[0], lambda body: [body])
    cls = StreamChannel if kind == "stream-channel" else ControlChannel
    chan = cls("127.0.0.1", lambda msg: handlers[0](msg), codec=codec)  # type: ignore[operator]
    mine = pathlib.Path(tempfile.gettempdir()) / f"asynckv-bench-control-{port_in}"
    theirs = pathlib.Path(tempfile.gettempdir()) / f"asynckv-bench-control-{port_out}"
    mine.write_text(await chan.start())
    for _ in range(500):
        if theirs.exists() and theirs.read_text():
            break
        await asyncio.sleep(0.01)
    peer = theirs.read_text()
    result = await _exchange(role, count, lambda msg: chan.send(peer, msg), handlers.append, lambda: None)
    await chan.close()
    mine.unlink(missing_ok=True)
    return result


async def _exchange(role: str, count: int, send: object, on_message: object, close: object) -> dict[str, float]:
    """Ping sends, pong echoes; ``count`` round trips after a warm-up. Returns the ping's round
    trips in microseconds and this process's CPU per round trip."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    state = {"seen": 0, "t0": 0.0}
    rtts: list[float] = []
    warm = 50

    def deliver(msg: bytes) -> None:
        state["seen"] += 1
        if role == "ping":
            if state["seen"] > warm:
                rtts.append(time.perf_counter() - state["t0"])
            if state["seen"] >= count + warm:
                if not done.done():
                    done.set_result(None)
                return
            state["t0"] = time.perf_counter()
        elif state["seen"] >= count + warm and not done.done():
            done.set_result(None)
        send(msg)  # type: ignore[operator]

    on_message(deliver)  # type: ignore[operator]
    await asyncio.sleep(0.3)  # (both sides listening and connected)
    if role == "ping":
        state["t0"] = time.perf_counter()
        send(MESSAGE)  # type: ignore[operator]
    while state["seen"] < warm:
        await asyncio.sleep(0.001)
    cpu = time.process_time()
    await asyncio.wait_for(done, 120)
    cpu = time.process_time() - cpu
    await asyncio.sleep(0.1)
    close()  # type: ignore[operator]
    ordered = sorted(rtts) or [0.0]
    return {"rtt_p50_us": ordered[len(ordered) // 2] * 1e6, "rtt_p90_us": ordered[int(len(ordered) * 0.9)] * 1e6,
            "cpu_us_per_round_trip": cpu / count * 1e6}


def child(transport: str, role: str, port_in: int, port_out: int, count: int) -> None:
    import uvloop

    uvloop.install()
    if transport.endswith("-channel"):
        result = asyncio.run(_channel(transport, role, port_in, port_out, count))
    else:
        result = asyncio.run((_zmq if transport == "zmq" else _tcp)(role, port_in, port_out, count))
    print("RESULT " + json.dumps(result), flush=True)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _pair(transport: str, count: int) -> dict[str, float]:
    a, b = _free_ports(2)
    cmd = [sys.executable, "-m", "benchmarks.bench_control", "--child", transport, "--messages", str(count)]
    cwd = pathlib.Path(__file__).parent.parent
    procs = [subprocess.Popen([*cmd, "--role", "pong", "--ports", str(a), str(b)], stdout=subprocess.PIPE, text=True,
                              cwd=cwd),
             subprocess.Popen([*cmd, "--role", "ping", "--ports", str(b), str(a)], stdout=subprocess.PIPE, text=True,
                              cwd=cwd)]
    out = [p.communicate(timeout=300)[0] for p in procs]
    rows = [json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[7:]) for o in out]
    pong, ping = rows
    return {"rtt_p50_us": ping["rtt_p50_us"], "rtt_p90_us": ping["rtt_p90_us"],
            "cpu_us_per_round_trip_ping": ping["cpu_us_per_round_trip"],
            "cpu_us_per_round_trip_pong": pong["cpu_us_per_round_trip"]}


def main(argv: list[str] | None = None, out_dir: pathlib.Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=TRANSPORTS)
    parser.add_argument("--role", choices=["ping", "pong"])
    parser.add_argument("--ports", type=int, nargs=2)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.role, args.ports[0], args.ports[1], args.messages)
        return {}
    print(f"control messages, one at a time ({args.messages} round trips, {args.rounds} rounds per transport):")
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
    for _ in range(args.rounds):
        for transport in runs:
            runs[transport].append(_pair(transport, args.messages))
    rows = []
    for transport, got in runs.items():
        row: dict[str, object] = {"transport": transport}
        for key in got[0]:
            values = [g[key] for g in got]
            row[key] = statistics.median(values)
            row[key + "_spread"] = [min(values), max(values)]
        rows.append(row)
        print(f"  {transport}: round trip p50 {row['rtt_p50_us']:.0f} us, p90 {row['rtt_p90_us']:.0f} us; CPU per "
              f"round trip {row['cpu_us_per_round_trip_ping']:.0f} us (ping process), "
              f"{row['cpu_us_per_round_trip_pong']:.0f} us (pong process)", flush=True)
    result = {"question": __doc__.strip().splitlines()[0], "messages": args.messages, "rounds": args.rounds,
              "rows": rows}
    write_result("control_transport", result, out_dir)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
