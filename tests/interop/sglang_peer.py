"""A stock SGLang 0.5.10 NIXL-connector rank, run with the SGLang venv's Python (never imported by
asynckv's own tests). Without a GPU or a scheduler it needs five shims, none of which touches
the connector or its wire:

- S1 a ``torchvision`` stub (PyPI torchvision needs libtorch_cuda; the connector never uses it),
  installed after transformers decided torchvision is unavailable;
- S2 NIXL ``VRAM`` registrations and descriptors as ``DRAM``, device 0 (UCX without CUDA refuses VRAM);
- S3 the attention TP/CP/DP accessors answer a single rank (no torch.distributed groups);
- S4 ``ServerArgs`` as a namespace of its declared defaults (a real one refuses to build without an
  accelerator);
- S5 ``SGLANG_HOST_IP=127.0.0.1``;
- S6 an ``sgl_kernel`` stub (SGLang's CUDA kernels; only its scheduler modules import it, at module
  level: the backend tests import them).

Role ``decode-send``: start SGLang's bootstrap server, register a prefill rank whose ZMQ endpoint
is the caller's (so the caller receives exactly what SGLang's decode sends), then run SGLang's
decode receiver for one room. Prints one JSON line with what it sent.

Role ``prefill-send``: SGLang's prefill for one room (prints its endpoints first, then waits for
the caller's registration and destination, sends the pages in chunks, and waits for DONE). With
chunk 0 it never sends: it holds the room until it is killed.

Role ``decode-recv``: SGLang's decode for one room, from the prefill at ``bootstrap``; polls until
Success or Failed (at most ``SECONDS``) and prints the outcome, how long it took, and its whole
KV and aux memory (hex) for the caller to check byte for byte. ``state`` sends state indices too.

    python sglang_peer.py decode-send <capture port> <room> <pages,comma,separated> <aux index> [bootstrap]
    python sglang_peer.py prefill-send <room> <source pages> <chunk pages> <source aux index> <mha|mla> [bootstrap]
    python sglang_peer.py decode-recv <bootstrap> <room> <destination pages> <aux index> <mha|mla> [state]
    python sglang_peer.py bench-prefill <spec json>
    python sglang_peer.py bench-decode <bootstrap> <spec json file>

Roles ``bench-prefill`` and ``bench-decode`` run SGLang's connector on a benchmark workload
(``benchmarks/bench_sglang.py``), driven the way its schedulers drive it: a loop that polls every
live sender or receiver.

Without ``bootstrap`` (host:port) a role starts SGLang's own bootstrap server. Geometry: 16 pages of
``ITEM`` bytes per KV buffer, ``2 * LAYERS`` buffers (MHA) or ``LAYERS`` (MLA), 10 aux buffers of
8 rows x 64 bytes; ``page_size`` 4 and ``kv_cache_dtype`` "auto".
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.abc
import importlib.machinery
import json
import os
import pathlib
import signal
import socket
import sys
import time
import types
from typing import Any

PAGE_SIZE, LAYERS, ITEM, PAGES = 4, 2, 256, 16
SECONDS = 60.0


STUBBED = ("torchvision", "sgl_kernel")


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """S1: ``torchvision`` and its submodules import as empty modules; S6: so does ``sgl_kernel``
    (SGLang's CUDA kernels, imported at module level by the scheduler modules, e.g. for the host
    KV cache; never called on a transfer path)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stub_attr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Anything:
    """Whatever a stubbed module is asked for at import time (a constant, a function, a class)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Anything()

    def __iter__(self) -> Any:
        return iter(())

    def __mro_entries__(self, bases: Any) -> tuple[type, ...]:
        return (object,)


def _stub_attr(attr: str) -> Any:
    if attr.startswith("__"):  # (version probes and the import machinery must see nothing)
        raise AttributeError(attr)
    return _Anything()


def install_shims() -> None:
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # (lru-cached: answers False before the stub exists)
    sys.meta_path.insert(0, _Stub())

    import numpy as np
    from nixl import _api

    register, descs = _api.nixl_agent.register_memory, _api.nixl_agent.get_xfer_descs

    def register_memory(self: Any, reg_list: Any, mem_type: str = "DRAM", *a: Any, **k: Any) -> Any:  # S2
        if mem_type == "VRAM":
            mem_type, reg_list = "DRAM", [(p, n, 0, s) for p, n, _, s in reg_list]
        return register(self, reg_list, mem_type, *a, **k)

    def get_xfer_descs(self: Any, rows: Any, mem_type: str = "DRAM", *a: Any, **k: Any) -> Any:
        if mem_type == "VRAM":
            rows = np.array(rows, dtype=np.int64).reshape(-1, 3)
            rows[:, 2] = 0
            mem_type = "DRAM"
        return descs(self, rows, mem_type, *a, **k)

    _api.nixl_agent.register_memory, _api.nixl_agent.get_xfer_descs = register_memory, get_xfer_descs

    from sglang.srt.disaggregation.common import conn as common  # S3
    for what in ("tp", "cp", "dp"):
        setattr(common, f"get_attention_{what}_size", lambda: 1)
        setattr(common, f"get_attention_{what}_rank", lambda: 0)
    common.get_pp_group = lambda: None


def server_args(port: int, page_size: int = PAGE_SIZE) -> types.SimpleNamespace:  # S4
    from sglang.srt.server_args import ServerArgs

    values: dict[str, Any] = {}
    if not dataclasses.is_dataclass(ServerArgs):  # SGLang 0.5.23: the fields a transfer backend reads
        values.update(dist_init_addr=None, pp_size=1, dp_size=1, enable_dp_attention=False, kv_cache_dtype="auto",
                      disaggregation_ib_device=None, enable_hisparse=False)
    for f in dataclasses.fields(ServerArgs) if dataclasses.is_dataclass(ServerArgs) else ():
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
        else:
            values[f.name] = None
    values.update(host="127.0.0.1", disaggregation_bootstrap_port=port, page_size=page_size,
                  load_balance_method="follow_bootstrap_room")
    return types.SimpleNamespace(**values)


def kv_args(buffers: list[Any], aux: list[Any]) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs

    args = KVArgs()
    args.engine_rank, args.gpu_id, args.pp_rank, args.prefill_start_layer, args.system_dp_rank = 0, 0, 0, 0, 0
    args.decode_tp_size, args.page_size, args.kv_head_num, args.total_kv_head_num = 1, PAGE_SIZE, 2, 2
    args.kv_data_ptrs = [int(b.ctypes.data) for b in buffers]
    args.kv_data_lens = [int(b.nbytes) for b in buffers]
    args.kv_item_lens = [int(b.shape[1]) for b in buffers]
    args.aux_data_ptrs = [int(a.ctypes.data) for a in aux]
    args.aux_data_lens = [int(a.nbytes) for a in aux]
    args.aux_item_lens = [int(a.shape[1]) for a in aux]
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens, args.state_type = [], [], [], "none"
    args.ib_device = None
    return args


def bootstrap(addr: str) -> tuple[str, int]:
    """``addr`` when given (a bootstrap server of the caller's), else SGLang's own on a free port."""
    if addr:
        return addr, int(addr.rpartition(":")[2])
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    NixlKVBootstrapServer("127.0.0.1", port)
    time.sleep(0.3)  # (it starts in a thread)
    return f"127.0.0.1:{port}", port


def decode_send(capture_port: int, room: int, pages: list[int], aux_index: int, boot: str) -> dict[str, Any]:
    import numpy as np
    import requests
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode

    addr, boot_port = bootstrap(boot)
    rank = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": "127.0.0.1", "rank_port": capture_port, "page_size": PAGE_SIZE, "kv_cache_dtype": "auto",
            "load_balance_method": "follow_bootstrap_room"}
    for _ in range(100):
        try:
            if requests.put(f"http://{addr}/route", json=rank, timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.05)
    buffers = [np.zeros((16, ITEM), dtype=np.uint8) for _ in range(2 * LAYERS)]
    aux = [np.zeros((8, 64), dtype=np.uint8) for _ in range(10)]
    args = kv_args(buffers, aux)
    mgr = NixlKVManager(args, DisaggregationMode.DECODE, server_args(boot_port), False)
    while not mgr.try_ensure_parallel_info(addr):
        time.sleep(0.05)
    receiver = NixlKVReceiver(mgr, addr, room)
    receiver.init(0)
    receiver.send_metadata(np.array(pages, dtype=np.int32), aux_index, None)
    time.sleep(0.5)  # (ZMQ hands the frames over in the background)
    return {"agent": mgr.agent.name, "kv_ptrs": args.kv_data_ptrs, "aux_ptrs": args.aux_data_ptrs,
            "item": ITEM, "ip": mgr.local_ip, "port": mgr.rank_port}


def pattern(buffer: int, page: int) -> int:
    """The byte every prefill page holds (the caller checks it landed)."""
    return (buffer * 31 + page * 7 + 1) % 251


def prefill_send(room: int, pages: list[int], chunk: int, aux_index: int, mla: bool, boot: str) -> dict[str, Any]:
    """SGLang's prefill for one room: prints its bootstrap address and ZMQ endpoint, waits for the
    room's destination, sends ``pages`` in chunks of ``chunk`` (the last one may be shorter) and the
    aux row, and waits until every NIXL handle is DONE (chunk 0: holds the room, never sends)."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode

    addr, boot_port = bootstrap(boot)
    buffers = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(LAYERS if mla else 2 * LAYERS)]
    for b, buf in enumerate(buffers):
        for page in range(PAGES):
            buf[page] = pattern(b, page)
    aux = [np.full((8, 64), 100 + i, dtype=np.uint8) for i in range(10)]
    args = kv_args(buffers, aux)
    mgr = NixlKVManager(args, DisaggregationMode.PREFILL, server_args(boot_port), mla)
    print(json.dumps({"bootstrap": addr, "endpoint": f"tcp://{mgr.local_ip}:{mgr.rank_port}"}), flush=True)
    sender = NixlKVSender(mgr, addr, room, [0], 0)
    deadline = time.monotonic() + SECONDS
    while sender.poll() != KVPoll.WaitingForInput:
        if time.monotonic() > deadline:
            raise SystemExit(f"no destination within {SECONDS} s")
        time.sleep(0.01)
    if chunk == 0:
        print(json.dumps({"holding": room}), flush=True)
        time.sleep(3600)
    sender.init(len(pages), aux_index)
    for start in range(0, len(pages), chunk):
        sender.send(np.array(pages[start:start + chunk], dtype=np.int32))
    while (state := sender.poll()) != KVPoll.Success:
        if time.monotonic() > deadline:
            raise SystemExit(f"transfer not done within 60 s ({state})")
        time.sleep(0.01)
    return {"done": True, "chunks": sender.chunk_id}


def decode_recv(boot: str, room: int, pages: list[int], aux_index: int, mla: bool, state: bool) -> dict[str, Any]:
    """SGLang's decode for one room from the prefill at ``boot``: the outcome, and its memory."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode

    buffers = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(LAYERS if mla else 2 * LAYERS)]
    aux = [np.zeros((8, 64), dtype=np.uint8) for _ in range(10)]
    args = kv_args(buffers, aux)
    mgr = NixlKVManager(args, DisaggregationMode.DECODE, server_args(int(boot.rpartition(":")[2])), mla)
    started = time.monotonic()
    deadline = started + SECONDS
    try:
        while not mgr.try_ensure_parallel_info(boot):
            if time.monotonic() > deadline:
                return {"outcome": "no parallel info", "seconds": time.monotonic() - started}
            time.sleep(0.05)
    except RuntimeError as exc:  # SGLang refuses a prefill whose page_size or kv_cache_dtype differ
        return {"outcome": "refused", "error": str(exc)}
    receiver = NixlKVReceiver(mgr, boot, room)
    receiver.init(0)
    receiver.send_metadata(np.array(pages, dtype=np.int32), aux_index, [0] if state else None)
    print(json.dumps({"sent": room, "agent": mgr.agent.name}), flush=True)
    started = time.monotonic()
    while (outcome := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
        if time.monotonic() > started + SECONDS:
            break
        time.sleep(0.01)
    names = {KVPoll.Success: "Success", KVPoll.Failed: "Failed"}  # (SGLang's KVPoll is a class of ints)
    return {"outcome": names.get(outcome, str(outcome)), "seconds": time.monotonic() - started,
            "kv": [b.tobytes().hex() for b in buffers], "aux": [a.tobytes().hex() for a in aux]}


WARMUP_ROOM = 1_000_000
"""The benchmark roles' warm-up room (first contact), served before the measured rooms 1..requests."""


def bench_pools(spec: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """A benchmark's KV pool (``buffers`` x ``inflight * pages`` pages of ``item`` bytes, faulted in)
    and its aux buffers (10 x ``inflight`` rows of 64 bytes): the geometry asynckv's side uses."""
    import numpy as np

    pages = spec["inflight"] * spec["pages"]
    kv = [np.ones((pages, spec["item"]), dtype=np.uint8) for _ in range(spec["buffers"])]
    return kv, [np.ones((spec["inflight"], 64), dtype=np.uint8) for _ in range(10)]


def bench_prefill(spec: dict[str, Any]) -> dict[str, Any]:
    """SGLang's prefill serving ``WARMUP_ROOM`` then rooms 1..requests the way its scheduler does: up to ``inflight``
    senders at once, each polled every loop iteration; request k's source is slot k's contiguous pages,
    sent as one chunk (``send()`` copies inside the call)."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode

    addr, boot_port = bootstrap("")
    kv, aux = bench_pools(spec)
    page_size, pages, inflight = spec["page_size"], spec["pages"], spec["inflight"]
    args = kv_args(kv, aux)
    args.page_size = page_size
    mgr = NixlKVManager(args, DisaggregationMode.PREFILL, server_args(boot_port, page_size), False)
    print(json.dumps({"bootstrap": addr}), flush=True)
    cpu0 = None  # (counted from the first destination after the warm-up room: before it, this loop only
    waiting = [WARMUP_ROOM, *range(1, spec["requests"] + 1)]  # waits for decode to start, then first contact)
    active: dict[int, tuple[Any, int, bool]] = {}  # room -> (sender, slot, sent)
    free = list(range(inflight))
    while waiting or active:
        while waiting and free:
            room = waiting.pop(0)
            active[room] = (NixlKVSender(mgr, addr, room, [0], 0), free.pop(), False)
        for room, (sender, slot, sent) in list(active.items()):
            state = sender.poll()
            if not sent and state == KVPoll.WaitingForInput:
                cpu0 = cpu0 or (os.times() if room != WARMUP_ROOM else None)
                sender.init(pages, slot)
                sender.send(np.arange(slot * pages, (slot + 1) * pages, dtype=np.int32))
                active[room] = (sender, slot, True)
            elif state in (KVPoll.Success, KVPoll.Failed):
                if state == KVPoll.Failed:
                    raise SystemExit(f"room {room} failed")
                del active[room]
                free.append(slot)
        time.sleep(0)
    cpu1 = os.times()
    assert cpu0 is not None
    return {"cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system}


def bench_decode(boot: str, spec: dict[str, Any]) -> dict[str, Any]:
    """SGLang's decode receiving rooms 1..requests with ``inflight`` in flight, polling every live
    receiver each loop iteration (notifications are drained inside ``poll()``); slot k's destination
    is ``spec["dst"][k]``. Latency: ``send_metadata`` to ``poll()`` == Success. ``WARMUP_ROOM`` warms the
    pair up first, outside the timing and the CPU count, as asynckv's side does."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
    from sglang.srt.disaggregation.utils import DisaggregationMode

    kv, aux = bench_pools(spec)
    args = kv_args(kv, aux)
    args.page_size = spec["page_size"]
    mgr = NixlKVManager(args, DisaggregationMode.DECODE, server_args(int(boot.rpartition(":")[2]),
                                                                     spec["page_size"]), False)
    while not mgr.try_ensure_parallel_info(boot):
        time.sleep(0.05)
    dst = [np.asarray(d, dtype=np.int32) for d in spec["dst"]]
    warmup = NixlKVReceiver(mgr, boot, WARMUP_ROOM)  # alone, before the timing: the first contact
    warmup.init(0)
    warmup.send_metadata(dst[0], 0, None)
    while (state := warmup.poll()) != KVPoll.Success:
        if state == KVPoll.Failed:
            raise SystemExit("warm-up room failed")
        time.sleep(0)
    cpu0, t0 = os.times(), time.perf_counter()
    waiting = list(range(1, spec["requests"] + 1))
    active: dict[int, tuple[Any, int, float]] = {}
    free = list(range(spec["inflight"]))
    latencies = []
    while waiting or active:
        while waiting and free:
            room, slot = waiting.pop(0), free.pop()
            receiver = NixlKVReceiver(mgr, boot, room)
            receiver.init(0)
            receiver.send_metadata(dst[slot], slot, None)
            active[room] = (receiver, slot, time.perf_counter())
        for room, (receiver, slot, started) in list(active.items()):
            state = receiver.poll()
            if state == KVPoll.Success:
                latencies.append(time.perf_counter() - started)
                del active[room]
                free.append(slot)
            elif state == KVPoll.Failed:
                raise SystemExit(f"room {room} failed")
        time.sleep(0)
    elapsed, cpu1 = time.perf_counter() - t0, os.times()
    return {"elapsed_s": elapsed, "latencies_s": latencies, "cpu_s": cpu1.user + cpu1.system - cpu0.user - cpu0.system}


def die_with_parent() -> None:
    """Be killed when the process that started us dies (Linux ``PR_SET_PDEATHSIG``): SGLang's connector has no
    liveness of its own, and a bench-prefill left behind by a killed benchmark kept serving nobody, spinning a
    whole core for as long as the machine ran (it skewed every later measurement)."""
    with contextlib.suppress(AttributeError, OSError):  # (not Linux: the caller's own cleanup is all there is)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> None:
    die_with_parent()
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")  # S5
    install_shims()
    role = sys.argv[1]
    if role == "decode-send":
        pages = [int(p) for p in sys.argv[4].split(",")]
        boot = sys.argv[6] if len(sys.argv) > 6 else ""
        print(json.dumps(decode_send(int(sys.argv[2]), int(sys.argv[3]), pages, int(sys.argv[5]), boot)), flush=True)
    elif role == "prefill-send":
        pages = [int(p) for p in sys.argv[3].split(",")]
        boot = sys.argv[7] if len(sys.argv) > 7 else ""
        print(json.dumps(prefill_send(int(sys.argv[2]), pages, int(sys.argv[4]), int(sys.argv[5]),
                                      sys.argv[6] == "mla", boot)), flush=True)
    elif role == "decode-recv":
        pages = [int(p) for p in sys.argv[4].split(",")]
        print(json.dumps(decode_recv(sys.argv[2], int(sys.argv[3]), pages, int(sys.argv[5]), sys.argv[6] == "mla",
                                     sys.argv[7:8] == ["state"])), flush=True)
    elif role == "bench-prefill":
        print(json.dumps(bench_prefill(json.loads(sys.argv[2]))), flush=True)
    elif role == "bench-decode":
        print(json.dumps(bench_decode(sys.argv[2], json.loads(pathlib.Path(sys.argv[3]).read_text()))), flush=True)
    else:
        raise SystemExit(f"unknown role {role!r}")
    os._exit(0)  # SGLang's reader threads are not daemons


if __name__ == "__main__":
    main()
