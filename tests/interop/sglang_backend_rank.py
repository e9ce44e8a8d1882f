"""One SGLang scheduler rank using asynckv as its transfer backend, run with the SGLang venv's
Python (asynckv imported from the checkout through PYTHONPATH). It replays what SGLang 0.5.10's
prefill and decode schedulers call, in their order, with the classes SGLang's own
``get_kv_class(TransferBackend("asynckv"), ...)`` returns after ``install()``, and MIN-reduces
every ``poll()`` over a real gloo process group with SGLang's own ``poll_and_all_reduce``.

Shims (none touches a transfer path): the five of ``sglang_peer.py`` (torchvision stub, VRAM as
DRAM, namespace ``ServerArgs``, loopback host), and SGLang's attention-parallel accessors answer
this rank's TP size and rank (a scheduler reads them from the process groups it made).

    python sglang_backend_rank.py classes
    python sglang_backend_rank.py bootstrap <port>
    python sglang_backend_rank.py launch-help
    python sglang_backend_rank.py poll-bench <queued requests> <iterations>
    python sglang_backend_rank.py prefill|decode <rank> <world> <gloo port> <bootstrap port> <plan json>

A plan is a list of rooms: ``{"room", "src", "dst", "chunk", "src_aux", "dst_aux", "abort"}`` where
``abort`` is ``"prefill"``, ``"decode"`` or null; ``"hold": true`` at the top makes prefill never
send (it holds every room until it is killed); ``"sglang_failure_path": true`` gives a failed
room only ``failure_exception()``, no ``clear()``, as SGLang's queues do (0.5.10 prefill.py:630,
decode.py:1066; 0.5.23 prefill.py:1236 and handle_bootstrap_failure). Each rank prints JSON lines:
``{"ready": ...}``,
then ``{"rank", "results": {room: "Success" | "Failed: <reason>"}, "failed_at": {room: unix time},
"bad_pages", "untouched", "room_counts"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang_peer import install_shims, server_args

LAYERS, PAGES, HEADS, HEAD_DIM, PAGE_SIZE = 2, 16, 2, 16, 4
ITEM = PAGE_SIZE * HEADS * HEAD_DIM * 2
"""Bytes of one page of one KV buffer on one rank (2 of the model's 4 KV heads, bf16)."""
SECONDS = 60.0


def pattern(rank: int, buffer: int, page: int) -> int:
    return (rank * 7 + buffer * 31 + page * 3 + 1) % 251


def shim_parallelism(rank: int, world: int) -> None:
    """SGLang's attention-parallel accessors answer this rank (a scheduler's read its process groups):
    0.5.23's runtime context, 0.5.10's ``dp_attention`` functions."""
    import types

    try:
        from sglang.srt import runtime_context
    except ImportError:
        from sglang.srt.layers import dp_attention

        dp_attention.get_attention_tp_size = lambda: world
        dp_attention.get_attention_tp_rank = lambda: rank
        dp_attention.get_attention_dp_size = lambda: 1
        dp_attention.get_attention_dp_rank = lambda: 0
        return
    parallel = types.SimpleNamespace(attn_tp_size=world, attn_tp_rank=rank, attn_dp_size=1, attn_dp_rank=0)
    runtime_context.get_parallel = lambda: parallel


def new_api() -> bool:
    """SGLang 0.5.23's scheduler calls (sender constructor, plugins) rather than 0.5.10's."""
    import sglang

    return bool(sglang.__version__ != "0.5.10")


def install_backend() -> None:
    """0.5.23: SGLang's own plugin loader finds asynckv's entry point; 0.5.10: ``install()``."""
    if new_api():
        from sglang.srt.plugins import load_plugins

        load_plugins()
    else:
        from asynckv.integrations.sglang import install

        install()


def classes() -> dict[str, Any]:
    """What SGLang's own ``get_kv_class`` answers before and after ``install()``."""
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.server_args import DISAGG_TRANSFER_BACKEND_CHOICES

    try:
        TransferBackend("asynckv")
        before = "known"
    except ValueError as exc:
        before = f"ValueError: {exc}"
    from sglang.srt.managers import disagg_service  # imported before install(): its binding is rebound

    from asynckv.integrations.sglang import install

    install_backend()
    install()  # (idempotent)
    from sglang.srt.disaggregation import decode, prefill  # imported after: they bind the new one

    backend = TransferBackend("asynckv")
    get_kv_class = utils.get_kv_class  # (read after install(), as the scheduler modules bind it)
    found = {t.value: f"{c.__module__}.{c.__qualname__}" for t in KVClassType
             if (c := get_kv_class(backend, t)) is not None}
    bound = {m.__name__: m.get_kv_class(backend, KVClassType.MANAGER).__module__
             for m in (prefill, decode, disagg_service)}
    nixl = get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER)
    return {"checks": settings_checks(), "before": before, "classes": found, "bound": bound,
            "nixl": f"{nixl.__module__}.{nixl.__qualname__}", "choices": list(DISAGG_TRANSFER_BACKEND_CHOICES),
            "member": backend.name}


def settings_checks() -> dict[str, Any]:
    """What the adapter makes of SGLang's inputs that the replayed sequences do not reach."""
    import types

    from asynckv.integrations.sglang.backend import AsynckvKVSender
    from asynckv.integrations.sglang.settings import as_state_indices, refuse_unsupported

    def refused(env: dict[str, str], **fields: Any) -> str:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            refuse_unsupported(types.SimpleNamespace(**fields), True)
            return ""
        except Exception as exc:
            return str(exc)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    try:
        as_state_indices([[1], [2]])
        two_kinds = ""
    except Exception as exc:
        two_kinds = str(exc)
    return {
        "state_0510": as_state_indices([3, 4]).tolist(), "state_0523": as_state_indices([[3, 4]]).tolist(),
        "state_empty": as_state_indices([]), "state_two_kinds": two_kinds,
        "empty_last_chunk": AsynckvKVSender.should_send_kv_chunk(None, 0, True),  # type: ignore[arg-type]
        "empty_middle_chunk": AsynckvKVSender.should_send_kv_chunk(None, 0, False),  # type: ignore[arg-type]
        "early_send": refused({"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "1"}),
        "round_robin": refused({}, dp_size=2, load_balance_method="round_robin"),
        "follow": refused({}, dp_size=2, load_balance_method="follow_bootstrap_room"),
        "failed_elsewhere": failed_elsewhere(),
    }


def failed_elsewhere() -> dict[str, str]:
    """A room another TP rank failed first (the MIN-reduce says Failed; this rank's room is open):
    ``failure_exception()`` aborts (decode) or clears (prefill) it, and that abort landing at once,
    before the reason is read, is scripted here. The reason must still say another rank failed it,
    and the room must be failed on this rank by the abort."""
    import types

    from asynckv.errors import AsyncKVError
    from asynckv.integrations.poll_state import PollState
    from asynckv.integrations.sglang.backend import AsynckvKVReceiver, AsynckvKVSender
    from asynckv.proto.states import KVPoll as Poll

    now = types.SimpleNamespace(submit=lambda fn, *args: fn(*args))  # (the loop thread runs it at once)
    receiver = AsynckvKVReceiver.__new__(AsynckvKVReceiver)
    receiver.mgr, receiver.bootstrap_room, receiver._room = (
        types.SimpleNamespace(thread=now), 41, PollState())  # type: ignore[assignment]
    receiver._clear_when_fenced, receiver.fenced, receiver.abort_notified = False, False, False
    # (the abort fails the room before failure_exception reads it)
    receiver._view = types.SimpleNamespace(  # type: ignore[assignment]
        abort_nowait=lambda reason: receiver._room.advance(Poll.Failed, AsyncKVError(reason)))
    sender = AsynckvKVSender.__new__(AsynckvKVSender)
    sender.bootstrap_room, sender._room, sender._cleared = 42, PollState(), False
    sender._on_loop = (  # type: ignore[method-assign]
        lambda *args, **kwargs: sender._room.advance(Poll.Failed, AsyncKVError("cleared")))
    out = {}
    for name, room in (("receiver", receiver), ("sender", sender)):
        try:
            room.failure_exception()
            out[name] = "(did not raise)"
        except Exception as exc:
            out[name] = f"{exc} | after: {room._room.error_text()}"
    return out


def bootstrap(port: int) -> None:
    install_backend()  # (before importing get_kv_class by name, as SGLang's own modules do)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = get_kv_class(TransferBackend("asynckv"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    print(json.dumps({"ready": type(server).__name__}), flush=True)
    sys.stdin.read()  # until the test closes it


def make_manager(mode: str, rank: int, boot_port: int) -> tuple[Any, Any, list[Any], list[Any]]:
    import numpy as np
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend("asynckv")
    kv = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(2 * LAYERS)]
    aux = [np.zeros((8, 64), dtype=np.uint8) for _ in range(10)]
    if mode == "prefill":
        for b, buf in enumerate(kv):
            for page in range(PAGES):
                buf[page] = pattern(rank, b, page)
        for i, rows in enumerate(aux):
            for r in range(8):
                rows[r] = (100 + i + r) % 251
    args = get_kv_class(backend, KVClassType.KVARGS)()  # as the schedulers fill it (prefill.py, decode.py)
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.prefill_start_layer = rank, 0, 0, 0
    args.kv_data_ptrs = [int(b.ctypes.data) for b in kv]
    args.kv_data_lens = [int(b.nbytes) for b in kv]
    args.kv_item_lens = [ITEM] * len(kv)
    args.kv_head_num, args.total_kv_head_num, args.page_size = HEADS, 2 * HEADS, PAGE_SIZE
    args.aux_data_ptrs = [int(a.ctypes.data) for a in aux]
    args.aux_data_lens = [int(a.nbytes) for a in aux]
    args.aux_item_lens = [64] * len(aux)
    args.state_data_ptrs, args.state_data_lens, args.state_item_lens, args.state_type = [], [], [], "none"
    args.state_types, args.kv_cache_dtype_str = [], "auto"  # (0.5.23's fields)
    args.ib_device, args.gpu_id = None, 0
    sa = server_args(boot_port, PAGE_SIZE)
    sa.kv_cache_dtype = "auto"
    mode_enum = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode_enum, sa, False)
    assert type(mgr).__module__.startswith("asynckv."), type(mgr)
    return mgr, get_kv_class(backend, KVClassType.SENDER if mode == "prefill" else KVClassType.RECEIVER), kv, aux


def failure(room: Any) -> str:
    """What the scheduler logs for a failed room: ``failure_exception()`` must raise, with the reason."""
    try:
        room.failure_exception()
    except Exception as exc:
        return f"Failed: {exc}"
    return "Failed: (failure_exception did not raise)"


def run_prefill(rank: int, group: Any, boot: str, plan: dict[str, Any], mgr: Any, sender_cls: Any) -> dict[str, Any]:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    rooms = {r["room"]: r for r in plan["rooms"]}
    extra: dict[str, Any] = {"req_has_disagg_prefill_dp_rank": False} if new_api() else \
        {"dest_tp_ranks": [rank], "pp_rank": 0}
    senders = {room: sender_cls(mgr=mgr, bootstrap_addr=boot, bootstrap_room=room, **extra)
               for room in rooms}  # PrefillBootstrapQueue.add
    sent: dict[int, int] = {}
    results: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    deadline = time.monotonic() + SECONDS
    while len(results) < len(rooms) and time.monotonic() < deadline:
        live = [room for room in rooms if room not in results]
        polls = poll_and_all_reduce([senders[room] for room in live], group)  # the same on every rank
        for room, poll in zip(live, polls, strict=True):
            spec, sender = rooms[room], senders[room]
            if poll == KVPoll.Failed:
                results[room], failed_at[room] = failure(sender), time.time()
                if not plan.get("sglang_failure_path"):  # (SGLang itself only calls failure_exception())
                    sender.clear()
            elif poll == KVPoll.Success:
                results[room] = "Success"
                sender.clear()
            elif poll == KVPoll.WaitingForInput and room not in sent and not plan.get("hold"):
                if spec.get("abort") == "prefill":
                    sender.abort()  # the client went away
                    sent[room] = -1
                elif spec.get("abort") != "decode":  # (rooms decode aborts wait for it)
                    sender.init(len(spec["src"]), spec["src_aux"])  # pop_bootstrapped
                    sent[room] = 0
            if sent.get(room, -1) >= 0 and sent[room] < len(spec["src"]) and poll != KVPoll.Failed:
                chunk = spec["src"][sent[room]:sent[room] + spec["chunk"]]  # send_kv_chunk, one per iteration
                sender.send(np.array(chunk, dtype=np.int32))
                sent[room] += len(chunk)
        time.sleep(0.002)
    return {"results": results, "failed_at": failed_at}


def run_decode(rank: int, group: Any, boot: str, plan: dict[str, Any], mgr: Any, receiver_cls: Any,
               kv: list[Any], aux: list[Any]) -> dict[str, Any]:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    rooms = {r["room"]: r for r in plan["rooms"]}
    receivers = {room: receiver_cls(mgr=mgr, bootstrap_addr=boot, bootstrap_room=room) for room in rooms}
    initialized: set[int] = set()
    metadata: dict[int, int] = {}  # room -> iteration its metadata went
    results: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    fenced_at_failure: dict[int, bool] = {}
    fenced_later: dict[int, bool] = {}
    bad_pages, iteration = 0, 0
    deadline = time.monotonic() + SECONDS
    while len(results) < len(rooms) and time.monotonic() < deadline:
        iteration += 1
        if mgr.try_ensure_parallel_info(boot):  # DecodePreallocQueue._resolve_pending_reqs
            info = mgr.prefill_info_table[boot]
            for room in rooms:
                if room not in initialized:
                    initialized.add(room)
                    receivers[room].init(0 if info.dp_size == 1 else room % info.dp_size)
        live = [room for room in rooms if room not in results]
        polls = poll_and_all_reduce([receivers[room] for room in live], group)
        for room, poll in zip(live, polls, strict=True):
            spec, receiver = rooms[room], receivers[room]
            if poll == KVPoll.Failed:
                results[room], failed_at[room] = failure(receiver), time.time()
                fenced_at_failure[room] = mgr.is_abort_release_safe(room, len(receiver.bootstrap_infos))
                if not fenced_at_failure[room]:  # 0.5.23's deferred release: hold the pages until it is
                    receiver.ensure_abort_notified(force_arm=True)
                    held_until = time.monotonic() + 10
                    while not mgr.is_abort_release_safe(room, 1) and time.monotonic() < held_until:
                        time.sleep(0.005)
                    fenced_later[room] = mgr.is_abort_release_safe(room, 1)
                if not plan.get("sglang_failure_path"):  # (SGLang 0.5.10 only calls failure_exception())
                    receiver.clear()
            elif poll == KVPoll.Success:
                results[room] = "Success"
                for b, buf in enumerate(kv):
                    for s, d in zip(spec["src"], spec["dst"], strict=True):
                        bad_pages += int(not (buf[d] == pattern(rank, b, s)).all())
                for i, rows in enumerate(aux):
                    bad_pages += int(not (rows[spec["dst_aux"]] == (100 + i + spec["src_aux"]) % 251).all())
                receiver.clear()
            elif poll == KVPoll.WaitingForInput and room not in metadata:
                receiver.send_metadata(np.array(spec["dst"], dtype=np.int32), spec["dst_aux"], None)
                metadata[room] = iteration
            elif spec.get("abort") == "decode" and room in metadata and metadata[room] == iteration - 5:
                receiver.abort()  # the client went away while the transfer was pending
        time.sleep(0.002)
    written = {d for r in rooms.values() if results.get(r["room"]) == "Success" for d in r["dst"]}
    untouched = all(not buf[[p for p in range(PAGES) if p not in written]].any() for buf in kv)
    return {"results": results, "failed_at": failed_at, "bad_pages": bad_pages, "untouched": untouched,
            "fenced_at_failure": fenced_at_failure, "fenced_later": fenced_later}


def poll_bench(queued: int, iterations: int) -> dict[str, Any]:
    """The scheduler loop's cost: ``queued`` prefill requests waiting for decode, each polled every
    iteration, asynckv's sender against SGLang's own ``NixlKVSender`` in the same process."""
    import socket

    from asynckv.integrations.sglang import install

    install()
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer, NixlKVManager, NixlKVSender
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

    shim_parallelism(0, 1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    get_kv_class(TransferBackend("asynckv"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    mgr, sender_cls, _kv, _aux = make_manager("prefill", 0, port)
    ours = [sender_cls(mgr=mgr, bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=r, dest_tp_ranks=[0], pp_rank=0)
            for r in range(1, queued + 1)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        sg_port = probe.getsockname()[1]
    NixlKVBootstrapServer("127.0.0.1", sg_port)
    time.sleep(0.3)
    import numpy as np
    from sglang_peer import kv_args

    sg_kv = [np.zeros((PAGES, ITEM), dtype=np.uint8) for _ in range(2 * LAYERS)]
    sg_aux = [np.zeros((8, 64), dtype=np.uint8) for _ in range(10)]
    sg_mgr = NixlKVManager(kv_args(sg_kv, sg_aux), DisaggregationMode.PREFILL, server_args(sg_port, PAGE_SIZE), False)
    theirs = [NixlKVSender(sg_mgr, f"127.0.0.1:{sg_port}", r, [0], 0) for r in range(1, queued + 1)]
    time.sleep(0.5)
    out: dict[str, Any] = {"queued": queued, "iterations": iterations}
    for name, senders in (("asynckv", ours), ("sglang", theirs), ("asynckv_again", ours)):
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter_ns()
            polls = [s.poll() for s in senders]
            samples.append((time.perf_counter_ns() - t0) / len(senders) / 1000)
        assert len(polls) == queued
        samples.sort()
        out[name] = {"median_us": samples[len(samples) // 2], "p99_us": samples[int(len(samples) * 0.99)]}
    return out


def main() -> None:
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    install_shims()
    role = sys.argv[1]
    if role == "classes":
        print(json.dumps(classes()), flush=True)
        os._exit(0)
    if role == "bootstrap":
        bootstrap(int(sys.argv[2]))
        os._exit(0)
    if role == "launch-help":  # python -m asynckv.integrations.sglang --help: SGLang's own CLI, backend installed
        import runpy

        sys.argv = ["asynckv.integrations.sglang", "--help"]
        runpy.run_module("asynckv.integrations.sglang", run_name="__main__", alter_sys=True)
    if role == "poll-bench":
        print(json.dumps(poll_bench(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
        os._exit(0)
    rank, world, gloo_port, boot_port = (int(x) for x in sys.argv[2:6])
    plan = json.loads(sys.argv[6])
    import torch.distributed as dist

    shim_parallelism(rank, world)
    install_backend()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    mgr, cls, kv, aux = make_manager(role, rank, boot_port)
    print(json.dumps({"ready": role, "rank": rank}), flush=True)
    boot = f"127.0.0.1:{boot_port}"
    out = run_prefill(rank, group, boot, plan, mgr, cls) if role == "prefill" \
        else run_decode(rank, group, boot, plan, mgr, cls, kv, aux)
    time.sleep(0.5)  # (statuses and goodbyes settle)

    async def counts() -> dict[str, int]:
        return dict(mgr.manager.room_counts())

    out.update(rank=rank, room_counts=mgr.thread.run(counts(), 10))
    print(json.dumps(out), flush=True)
    if plan.get("hold") and role == "prefill":
        time.sleep(3600)  # until killed
    dist.barrier(group)
    mgr.close()
    os._exit(0)


if __name__ == "__main__":
    main()
