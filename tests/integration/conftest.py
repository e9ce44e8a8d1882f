"""Prefill/decode pairs over real NIXL (DRAM, UCX), real ZMQ and a real bootstrap server."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from asynckv import Config, KVManager, KVPoll, Mode
from asynckv.testing import KVPool, fill_aux, fill_pages, verify_aux, verify_pages

CONTROL: dict[str, Any] = (
    {"control_transport": os.environ["ASYNCKV_CONTROL_TRANSPORT"]} if "ASYNCKV_CONTROL_TRANSPORT" in os.environ else {})
"""The control transport of the managers built here: the default (streams), or ASYNCKV_CONTROL_TRANSPORT,
so the integration tier runs on either (CI runs it on both). Tests marked ``zmq_wire`` speak raw ZMQ
to a rank: theirs, and their child processes', always run on ZMQ."""


@pytest.fixture(autouse=True)
def _zmq_for_raw_zmq_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("zmq_wire"):
        monkeypatch.setitem(CONTROL, "control_transport", "zmq")
        monkeypatch.setenv("ASYNCKV_CONTROL_TRANSPORT", "zmq")


@pytest.fixture(scope="session", autouse=True)
def netns_session() -> Iterator[tuple[str, str] | str]:
    """The partition test's namespaces, made before this process creates its first UCX
    context: UCX lists the host's network interfaces once, so a veth added later is
    invisible to this process's agents."""
    from .test_partition import drop_netns, make_netns

    made = make_netns()
    yield made
    if not isinstance(made, str):
        drop_netns(made)


@pytest.fixture
def netns(netns_session: tuple[str, str] | str) -> tuple[str, str]:
    """(namespace, host-side interface) of the veth pair, or the test is skipped with why not."""
    if isinstance(netns_session, str):
        pytest.skip(netns_session)
    return netns_session


@dataclasses.dataclass
class Pair:
    prefill: KVManager
    decode: KVManager
    ppool: KVPool
    dpool: KVPool

    @property
    def addr(self) -> str:
        addr = self.prefill.bootstrap_addr
        assert addr is not None
        return addr

    def assert_no_room_state(self) -> None:
        for mgr in (self.prefill, self.decode):
            assert all(v == 0 for v in mgr.room_counts().values()), mgr.room_counts()


@contextlib.asynccontextmanager
async def make_pair(entries: int = 4, pages: int = 64, item: int = 256, *, mla: bool = False,
                    page_size: int = 4, decode_fields: dict[str, Any] | None = None,
                    **config: Any) -> AsyncIterator[Pair]:
    control = CONTROL if config.get("wire", "asynckv") == "asynckv" else {}  # (SGLang's wire is ZMQ's)
    cfg = Config(**{"waiting_timeout_s": 30.0, "bootstrap_timeout_s": 30.0, **control, **config})
    ppool = KVPool(entries, pages, item, aux_rows=16)
    dpool = KVPool(entries, pages, item, aux_rows=16)
    dargs = dpool.kv_args(**{"page_size": page_size, "is_mla": mla, **(decode_fields or {})})
    async with KVManager(Mode.PREFILL, ppool.kv_args(page_size, is_mla=mla), bootstrap_addr="127.0.0.1:0",
                         config=cfg) as p, KVManager(Mode.DECODE, dargs, config=cfg) as d:
        yield Pair(p, d, ppool, dpool)


async def transfer_room(pair: Pair, room: int, src: Any, dst: Any, *, chunk: int | None = None,
                        src_aux: int = -1, dst_aux: int = -1) -> tuple[KVPoll, KVPoll]:
    """Fill ``src`` with room's pattern, move it to ``dst`` in chunks, return both outcomes."""
    src, dst = np.asarray(src), np.asarray(dst)
    fill_pages(pair.ppool, room, src)
    if src_aux >= 0:
        fill_aux(pair.ppool, room, src_aux)
    receiver = pair.decode.receiver(pair.addr, room)
    sender = pair.prefill.sender(room)
    assert await receiver.init(dst, dst_aux) == KVPoll.WaitingForInput, receiver.failure_reason
    assert await sender.wait_ready(10) == KVPoll.WaitingForInput
    sender.init(len(src), src_aux)
    step = chunk or max(len(src), 1)
    for i in range(0, max(len(src), 1), step):
        await sender.send(src[i:i + step])
    results = await sender.wait(10), await receiver.wait(10)
    sender.clear()
    receiver.clear()
    return results


def check_landed(pair: Pair, room: int, dst: Any, dst_aux: int = -1) -> None:
    assert verify_pages(pair.dpool, room, dst) == 0
    if dst_aux >= 0:
        assert verify_aux(pair.dpool, room, dst_aux) == 0
