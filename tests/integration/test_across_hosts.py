"""Across hosts, proven with two network namespaces joined by a veth pair (UCX then goes over
TCP, as between two machines): with a token, rooms move byte-exact; without a token or the
opt-out, protected mode refuses the remote peer at once with the reason. Needs root and
iproute2; skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from asynckv import BootstrapServer, Config, KVManager, KVPoll, Mode
from asynckv.demo import DemoSpec
from asynckv.proto.auth import PROTECTED_MODE_REASON
from asynckv.proto.messages import Ping, encode
from asynckv.testing import KVPool, fill_pages, verify_pages
from asynckv.transport.control import ControlChannel

from .conftest import CONTROL
from .test_partition import HOST_IP, NS_IP

pytestmark = pytest.mark.integration

TOKEN = "across-hosts-test-secret"
STARTED = (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)
SPEC = DemoSpec(layers=2, kv_heads=2, head_dim=16, page_size=4, min_pages=4, max_pages=12, chunk_pages=4, seed=9,
                requests=4, inflight=4)


async def _prefill_in_namespace(ns: str, spec: DemoSpec, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", ns, sys.executable, "-m", "asynckv", "_worker", "prefill",
        json.dumps(dataclasses.asdict(spec)), env={**os.environ, "ASYNCKV_HOST": NS_IP, **env},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)


async def _stop(proc: asyncio.subprocess.Process) -> bytes:
    if proc.returncode is None:
        proc.kill()
    _, err = await proc.communicate()
    return err or b""


async def test_with_a_token_rooms_move_byte_exact_between_namespaces(netns: tuple[str, str]) -> None:
    ns, _ = netns
    pool = KVPool(SPEC.entries, SPEC.requests * SPEC.max_pages, SPEC.item_bytes, aux_rows=SPEC.requests)
    async with BootstrapServer(HOST_IP, 0, auth_token=TOKEN) as server:
        spec = dataclasses.replace(SPEC, bootstrap=server.addr)
        proc = await _prefill_in_namespace(ns, spec, {"ASYNCKV_AUTH_TOKEN": TOKEN})
        try:
            cfg = Config(**CONTROL, host=HOST_IP, auth_token=TOKEN, waiting_timeout_s=60, bootstrap_timeout_s=60)
            async with KVManager(Mode.DECODE, pool.kv_args(spec.page_size), config=cfg) as d:
                receivers = []
                for i, r in enumerate(spec.plan()):
                    receiver = d.receiver(server.addr, r.room)
                    pages = np.arange(r.num_pages) + spec.max_pages * i
                    # (the prefill sends as soon as it hears: a descheduled decode may find it done)
                    assert await receiver.init(pages, i) in STARTED, receiver.failure_reason
                    receivers.append((receiver, r, pages))
                results = await asyncio.gather(*(rv.wait(60) for rv, _, _ in receivers))
                assert results == [KVPoll.Success] * len(receivers), [rv.failure_reason for rv, _, _ in receivers]
                for _, r, pages in receivers:
                    assert verify_pages(pool, r.room, pages) == 0  # every byte of every page
                assert d.control.dropped["auth_missing"] == d.control.dropped["not_loopback"] == 0
        finally:
            await _stop(proc)


async def test_without_a_token_the_remote_peer_is_refused_with_the_reason(netns: tuple[str, str]) -> None:
    ns, _ = netns
    pool = KVPool(SPEC.entries, 64, SPEC.item_bytes, aux_rows=4)
    async with BootstrapServer(HOST_IP, 0) as server:  # no token, no opt-out: protected mode
        spec = dataclasses.replace(SPEC, bootstrap=server.addr)
        t = time.monotonic()
        proc = await _prefill_in_namespace(ns, spec, {})
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            rc = proc.returncode
            print(f"remote prefill refused and exited ({rc}) after {time.monotonic() - t:.2f} s")
            assert rc != 0 and b"protected mode" in err, err[-2000:]
            assert server.table.registered == 0
            # a decode that reaches the server over a non-loopback address is refused too, at once
            cfg = Config(**CONTROL, host=HOST_IP, waiting_timeout_s=60, bootstrap_timeout_s=60)
            async with KVManager(Mode.DECODE, pool.kv_args(spec.page_size), config=cfg) as d:
                receiver = d.receiver(server.addr, 7)
                t = time.monotonic()
                assert await receiver.init([1, 2]) == KVPoll.Failed
                assert time.monotonic() - t < 5.0
                assert "protected mode" in (receiver.failure_reason or ""), receiver.failure_reason
        finally:
            await _stop(proc)


@pytest.mark.zmq_wire
async def test_protected_mode_drops_control_messages_from_other_addresses(netns: tuple[str, str]) -> None:
    """The veth address is this host's but not loopback: what arrives over it is refused unread;
    a registration hears why. With the opt-out, the same message is handled."""
    seen: list[object] = []
    refused: list[tuple[object, str]] = []
    for loopback_only in (True, False):
        channel = ControlChannel(HOST_IP, seen.append, loopback_only=loopback_only,
                                 on_refused=lambda msg, origin: refused.append((msg, origin)))
        endpoint = await channel.start()
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoint)
        try:
            await push.send_multipart(encode(Ping("someone", f"tcp://{HOST_IP}:1", 1, 1)))
            for _ in range(400):
                if channel.received:
                    break
                await asyncio.sleep(0.005)
            assert channel.received == 1
            assert channel.dropped["not_loopback"] == (1 if loopback_only else 0)
        finally:
            push.close(0)
            ctx.term()
            await channel.close()
    assert len(seen) == 1 and len(refused) == 1 and refused[0][1] == HOST_IP
    assert "ASYNCKV_AUTH_TOKEN" in PROTECTED_MODE_REASON


_IMPOSTOR = """
import json, sys, zmq
from asynckv.proto.messages import Register, TransferInfo, decode, encode
from asynckv.proto.topology import stub_agent_metadata
import numpy as np
target, host, room, prefill_id = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
port = pull.bind_to_random_port(f"tcp://{host}")
push = ctx.socket(zmq.PUSH)
push.connect(target)
reg = Register("impostor", prefill_id, 1, 3000, f"tcp://{host}:{port}", 0, 1, 4, "uint8", "DRAM", False, 0,
               (1 << 20,) * 4, (1 << 16,) * 4, (256,) * 4, (0, 1, 2, 3), (), (), (), 0, 0, 2, 2, "none",
               (), (), (), (), (), (), stub_agent_metadata("impostor"))
push.send_multipart(encode(reg))
push.send_multipart(encode(TransferInfo(room, 1, "impostor", prefill_id, -1, 1, False, True, 0,
                                        np.arange(4, dtype=np.int32), np.empty(0, np.int32))))
answers = []
if pull.poll(5000):
    msg = decode(pull.recv_multipart())
    answers.append({"ok": msg.ok, "reason": msg.reason})
print(json.dumps(answers))
"""


@pytest.mark.zmq_wire
async def test_an_impostor_on_another_host_cannot_claim_a_room_without_a_token(netns: tuple[str, str]) -> None:
    """Without a token, a prefill bound to every interface (0.0.0.0) used to accept a remote process's
    registration and destination: it sent its TransferInfo first and got the room's KV pages. Now the
    remote peer hears the protected-mode refusal, and the local decode's room succeeds."""
    from .conftest import make_pair

    ns, _ = netns
    async with make_pair(host="0.0.0.0") as pair:  # local peers reach 0.0.0.0 over loopback
        port = pair.prefill.endpoint.rpartition(":")[2]
        receiver, sender = pair.decode.receiver(pair.addr, 31), pair.prefill.sender(31)
        imp = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, "-c", _IMPOSTOR, f"tcp://{HOST_IP}:{port}", NS_IP, "31",
            pair.prefill.name, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(imp.communicate(), 30)
        answers = json.loads(out or b"[]")
        assert answers and not answers[0]["ok"] and "protected mode" in answers[0]["reason"], (out, err[-1500:])
        assert pair.prefill.control.dropped["not_loopback"] == 2
        fill_pages(pair.ppool, 31, [1, 2])
        assert await receiver.init([4, 5]) == KVPoll.WaitingForInput
        assert await sender.wait_ready(10) == KVPoll.WaitingForInput
        sender.init(2)
        await sender.send([1, 2])
        assert await receiver.wait(10) == KVPoll.Success and await sender.wait(10) == KVPoll.Success
        assert verify_pages(pair.dpool, 31, [4, 5]) == 0  # the pages went to the real decode, byte-exact
        assert [p["peer"] for p in pair.prefill.snapshot()["peers"]] == [pair.decode.name]
