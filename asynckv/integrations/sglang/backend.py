"""SGLang's backend interface on asynckv: the manager, sender, receiver and bootstrap-server classes
(see the package docstring for what they promise)."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
)

from ...config import Config
from ...errors import AsyncKVError
from ...proto.states import KVPoll as Poll
from ...service.bootstrap import BootstrapServer
from ...service.manager import KVManager, Mode
from ...service.receiver import KVReceiver
from ...service.sender import KVSender
from ..loop_thread import LoopThread
from ..poll_state import PollState
from .settings import (
    PrefillInfo,
    SglangTransferError,
    as_state_indices,
    asynckv_args,
    bootstrap_host,
    client_host,
    local_ip,
    refuse_unsupported,
)

__all__ = [
    "CLASSES",
    "AsynckvKVBootstrapServer",
    "AsynckvKVManager",
    "AsynckvKVReceiver",
    "AsynckvKVSender",
]

log = logging.getLogger("asynckv.sglang")

START_TIMEOUT_S = 120.0


# -- the manager -----------------------------------------------------------------------------


class AsynckvKVManager(BaseKVManager):  # type: ignore[misc]
    """One asynckv ``KVManager`` per scheduler (TP rank) process, on the background loop."""

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        self.kv_args = args
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.disaggregation_mode = disaggregation_mode
        self.thread = LoopThread.shared()
        prefill = getattr(disaggregation_mode, "value", disaggregation_mode) == "prefill"
        refuse_unsupported(server_args, prefill)
        host = os.environ.get("ASYNCKV_HOST") or local_ip()
        config = Config.from_env(host=host, host_bootstrap=False, wire="asynckv")  # (both sides are asynckv)
        bootstrap = f"{client_host(bootstrap_host(server_args))}:{server_args.disaggregation_bootstrap_port}"
        self.manager = KVManager(Mode.PREFILL if prefill else Mode.DECODE,
                                 asynckv_args(args, server_args, self.is_mla_backend),
                                 bootstrap_addr=bootstrap if prefill else None, config=config)
        self.thread.run(self.manager.start(), START_TIMEOUT_S)
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        """Decode: prefill instances looked up (SGLang's decode scheduler reads ``dp_size`` and
        ``follow_bootstrap_room`` from it)."""
        self._looking_up: set[str] = set()
        self.receivers: dict[int, AsynckvKVReceiver] = {}
        """Decode: this rank's receivers by room, until cleared (for ``is_abort_release_safe``)."""

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang 0.5.23 compares a checksum prefill computed over its KV with one over ours: only
        comparable when both sides hold the same heads (equal TP)."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is not None and info.tp_size == self.manager.kv_args.tp_size

    def misrouted(self, room: int) -> str:
        """Why a prefill request of ``room`` cannot be served on this DP rank ("" if it can): asynckv's
        decode sends room r to DP rank r % dp_size (SGLang's ``follow_bootstrap_room``)."""
        a = self.manager.kv_args
        if a.dp_size > 1 and room % a.dp_size != a.dp_rank:
            return (f"room {room} reached prefill DP rank {a.dp_rank}; asynckv's decode sends it to DP rank "
                    f"{room % a.dp_size} (room % dp_size): route prefill requests with --load-balance-method "
                    f"follow_bootstrap_room")
        return ""

    def register_to_bootstrap(self) -> None:
        """Done by the prefill manager when it starts (and renewed until it closes)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: whether the prefill at ``bootstrap_addr`` is known; if not, start looking it up
        (never blocks: the scheduler calls again on a later iteration)."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        if bootstrap_addr not in self._looking_up:
            self._looking_up.add(bootstrap_addr)
            self.thread.submit(self._look_up, bootstrap_addr)
        return False

    def _look_up(self, addr: str) -> None:
        task = self.manager.loop.create_task(self.manager.prefill_instance(addr, connect=True))

        def done(task: Any) -> None:
            self._looking_up.discard(addr)
            if task.cancelled():
                return
            error = task.exception()
            if error is None:
                self.prefill_info_table[addr] = PrefillInfo(task.result().dp_size, task.result().tp_size)
            else:  # (SGLang calls again, and gives up after its retries)
                log.warning("prefill at %s: %s", addr, error)

        task.add_done_callback(done)

    enable_deferred_decode_kv_release = True
    """With SGLang 0.5.23's ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1``, SGLang holds a failed
    room's pages until ``is_abort_release_safe`` (asynckv's fence): also a room another TP rank failed
    first, which this rank aborts when it learns of it (docs/integration.md)."""

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Whether no prefill can still write into ``room``'s pages on this rank (its fence)."""
        receiver = self.receivers.get(room)
        return receiver is None or receiver.fenced

    def clear_deferred_abort_state(self, room: int) -> None:
        """SGLang 0.5.23 released the pages: the room is cleared already, or when ``clear()`` comes."""

    def close(self) -> None:
        """Close the asynckv manager (SGLang 0.5.23 calls ``teardown()``; 0.5.10 has no such call)."""
        self.thread.run(self.manager.close(), START_TIMEOUT_S)

    def teardown(self) -> None:
        self.close()


# -- senders and receivers -----------------------------------------------------------------------


class AsynckvKVSender(BaseKVSender):  # type: ignore[misc]
    """The prefill side of one request; every call returns at once (the loop does the work)."""

    def __init__(self, mgr: AsynckvKVManager, bootstrap_addr: str, bootstrap_room: int,
                 dest_tp_ranks: list[int] | None = None, pp_rank: int = 0,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        # (0.5.10 passes dest_tp_ranks and pp_rank, 0.5.23 req_has_disagg_prefill_dp_rank: asynckv maps
        # ranks itself, from both sides' registrations)
        self.mgr = mgr
        self.bootstrap_room = bootstrap_room
        self._room = PollState()
        self._view: KVSender | None = None
        self._prefix_taken = False
        self._cleared = False
        self._early: list[tuple[Any, tuple[Any, ...]]] | None = []
        """Calls that need the room ready, made before it was (a PP stage > 0 polls through stage 0):
        run once it is."""
        misrouted = mgr.misrouted(bootstrap_room)
        if misrouted:
            self._room.advance(Poll.Failed, AsyncKVError(misrouted))
        mgr.thread.submit(self._open)

    def _open(self) -> None:
        try:
            view = self._view = self.mgr.manager.sender(self.bootstrap_room)
        except Exception as exc:
            self._room.advance(Poll.Failed, exc)
            return
        if self._room.state == Poll.Failed:  # (misrouted: the decode is told at once)
            view.abort(self._room.error_text())
        view.on_ready(self._on_ready)
        view.on_done(lambda poll: self._room.advance(int(poll), view.failure_exception()))

    def _on_ready(self, poll: Any) -> None:
        view = self._view
        if view is None:
            return
        self._room.advance(int(poll), view.failure_exception())
        early, self._early = self._early, None
        for fn, args in early or ():
            self._call(view, fn, args)

    def _call(self, view: KVSender, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            fn(view, *args)
        except Exception as exc:
            self._room.advance(Poll.Failed, exc)
            view.abort(str(exc))

    def _on_loop(self, fn: Any, *args: Any, when_ready: bool = False, at_once: bool = False) -> None:
        """Run ``fn(view, *args)`` on the loop, in call order (``when_ready``: not before the room is
        ready; ``at_once``: ahead of calls waiting for that, as an abort must); an error fails the room."""
        def run() -> None:
            view = self._view
            if view is None:
                return  # (the room failed to open: poll() says Failed already)
            if self._early is not None and not at_once and (when_ready or self._early):
                self._early.append((fn, args))  # (and every later call, to keep their order)
                return
            self._call(view, fn, args)

        self.mgr.thread.submit(run)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._on_loop(KVSender.init, int(num_kv_indices), -1 if aux_index is None else int(aux_index))

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None) -> None:
        self._room.advance(Poll.Transferring)
        pages = np.asarray(kv_indices, dtype=np.int64).copy()  # (the scheduler may reuse its array)
        try:
            state = as_state_indices(state_indices)
        except AsyncKVError as exc:  # (never raised into the scheduler: the room fails with it)
            self._room.advance(Poll.Failed, exc)
            self._on_loop(KVSender.abort, str(exc))
            return
        self._on_loop(KVSender.send_nowait, pages, state, when_ready=True)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """SGLang 0.5.23 skips a chunk this says no to: an empty last chunk still goes (it carries
        the aux row and state, and concludes the room when decode already holds every page)."""
        return num_pages > 0 or last_chunk

    def poll(self) -> int:
        return self._room.state

    def pop_decode_prefix_len(self) -> int:
        """Tokens decode already holds (SGLang 0.5.23 asks once, after WaitingForInput)."""
        view = self._view
        if view is None or self._prefix_taken:
            return 0
        self._prefix_taken = True
        return int(view.decode_prefix_len)

    def get_transfer_metric(self) -> Any:
        """SGLang 0.5.23's per-request metric: asynckv's are in its own metrics (``/metrics``)."""
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        return KVTransferMetric()

    def failure_exception(self) -> None:
        """Raise the reason; SGLang drops a failed request after this without ``clear()``, so it clears
        here (a room another TP rank failed, still open on this rank, is aborted by the clear)."""
        error = self._room.failure(f"asynckv room {self.bootstrap_room}", SglangTransferError)
        self.clear()  # (after the reason is read)
        raise error

    def abort(self) -> None:
        self._room.advance(Poll.Failed, AsyncKVError("aborted by the scheduler"))  # (prefill's own pages:
        self._on_loop(KVSender.abort, "aborted by the scheduler", at_once=True)  # nothing is written into them)

    def clear(self) -> None:
        if not self._cleared:  # (sends still waiting for readiness then find the room gone: dropped)
            self._cleared = True
            self._on_loop(KVSender.clear, at_once=True)


class AsynckvKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """The decode side of one request; every call returns at once (the loop does the work).

    SGLang gives a room's pages back as soon as ``poll()`` (MIN over the TP group) says Failed, so
    this rank's own failures and aborts read Failed only once asynckv fenced the room (``fenced``:
    no prefill can still write into its pages). 0.5.23's deferred release asks for exactly that
    (``ensure_abort_notified``, ``kv_mgr.is_abort_release_safe``) when a room failed elsewhere first."""

    require_staging = False
    """SGLang's decode scheduler reads it: asynckv never stages."""
    bootstrap_infos = (None,)
    """SGLang 0.5.23 waits for ``len(bootstrap_infos)`` acknowledgements of an abort: the fence is one."""

    def __init__(self, mgr: AsynckvKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 prefill_dp_rank: int | None = None) -> None:
        self.mgr = self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self._room = PollState()
        self._view: KVReceiver | None = None
        self._cleared = False
        self._clear_when_fenced = False
        self.abort_notified = False
        """An abort of this rank's room was started (SGLang 0.5.23 reads it)."""
        self.fenced = False
        """The room's outcome is decided and no prefill can still write into its pages."""
        mgr.receivers[self.bootstrap_room] = self
        mgr.thread.submit(self._open)

    def _open(self) -> None:
        try:
            view = self._view = self.mgr.manager.receiver(self.bootstrap_addr, self.bootstrap_room)
        except Exception as exc:
            self._room.advance(Poll.Failed, exc)
            self.fenced = True
            return
        view.on_done(self._on_done)

    def _on_done(self, poll: Any) -> None:
        view = self._view
        self._room.advance(int(poll), None if view is None else view.failure_exception())
        self.fenced = True
        if self._clear_when_fenced:
            self._clear()

    def init(self, prefill_dp_rank: int | None = None) -> None:
        """Look the prefill up (asynckv maps the room to its DP rank itself); WaitingForInput follows."""
        self.mgr.thread.submit(self._resolve)

    def _resolve(self) -> None:
        mgr = self.mgr
        task = mgr.manager.loop.create_task(mgr.manager.prefill_instance(self.bootstrap_addr))

        def done(task: Any) -> None:
            if task.cancelled():
                self._fail_unsent(AsyncKVError("look-up cancelled"))
            elif task.exception() is not None:
                self._fail_unsent(task.exception())
            else:
                self._room.advance(Poll.WaitingForInput)

        task.add_done_callback(done)

    def _fail_unsent(self, error: BaseException) -> None:
        """Fail a room whose destination never went out (no prefill writes into it: fenced already)."""
        self._room.advance(Poll.Failed, error)
        if self._view is not None:
            self._view.abort_nowait(str(error))

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None) -> None:
        self._room.advance(Poll.Transferring)
        pages = np.asarray(kv_indices, dtype=np.int64).copy()
        aux = -1 if aux_index is None else int(aux_index)
        try:
            state = as_state_indices(state_indices)
            if destination is not None and str(getattr(destination, "value", destination)) != "device":
                raise AsyncKVError(f"destination {destination}: asynckv writes device (pool) pages only; host "
                                   f"destinations are not supported")
        except AsyncKVError as exc:
            self.mgr.thread.submit(self._fail_unsent, exc)
            return
        self.mgr.thread.submit(self._start, pages, aux, state, int(decode_prefix_len or 0))

    @property
    def conclude_state(self) -> int | None:
        """The outcome once decided (SGLang 0.5.23 reads it), else None."""
        state = self._room.state
        return state if state in (Poll.Success, Poll.Failed) else None

    def _start(self, pages: Any, aux: int, state: Any, prefix: int) -> None:
        view = self._view
        if view is None:
            return
        try:
            view.init_nowait(pages, aux, state, prefix)
        except Exception as exc:  # (refused before anything went out: failed at once)
            self._fail_unsent(exc)

    def poll(self) -> int:
        return self._room.state

    def failure_exception(self) -> None:
        """Raise the reason. SGLang drops a failed request after this without ``clear()`` (0.5.10): the
        room is cleared here, once fenced; one still open on this rank (another TP rank failed it
        first) is aborted by it, so its prefill stops writing (docs/integration.md, limits)."""
        error = self._room.failure(f"asynckv room {self.bootstrap_room}", SglangTransferError)
        self.ensure_abort_notified()  # (after the reason is read)
        raise error

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """Abort this rank's room if it is still open, and clear it once fenced (SGLang 0.5.23 calls
        this before holding the pages until ``kv_mgr.is_abort_release_safe``)."""
        self.abort_notified = True
        self.mgr.thread.submit(self._abort, True)

    def abort(self) -> None:
        """Fail the room on both sides; ``poll()`` says Failed once asynckv fenced it."""
        self.abort_notified = True
        self.mgr.thread.submit(self._abort, False)

    def _abort(self, then_clear: bool) -> None:
        view = self._view
        if view is None:
            self._fail_unsent(AsyncKVError("aborted by the scheduler"))
            return
        if then_clear:
            self._clear_when_fenced = True
        if self.fenced:
            if then_clear:
                self._clear()
            return
        view.abort_nowait("aborted by the scheduler")

    def clear(self) -> None:
        self.mgr.thread.submit(self._clear)

    def _clear(self) -> None:
        if self._cleared:
            return
        self._cleared = True
        if self._view is not None:
            self._view.clear()
        if self.mgr.receivers.get(self.bootstrap_room) is self:
            del self.mgr.receivers[self.bootstrap_room]


class AsynckvKVBootstrapServer(BaseKVBootstrapServer):  # type: ignore[misc]
    """asynckv's bootstrap server, on the background loop of the process that builds it (SGLang's
    tokenizer manager)."""

    def __init__(self, host: str, port: int) -> None:
        config = Config.from_env(wire="asynckv")
        self.thread = LoopThread.shared()
        self.server = BootstrapServer(host or "0.0.0.0", port, config.auth_token,
                                      allow_unauthenticated=config.allow_unauthenticated)
        self.thread.run(self.server.start(), START_TIMEOUT_S)

    def close(self) -> None:
        self.thread.run(self.server.close(), START_TIMEOUT_S)


CLASSES: dict[str, Any] = {"kvargs": KVArgs, "manager": AsynckvKVManager, "sender": AsynckvKVSender,
                           "receiver": AsynckvKVReceiver, "bootstrap_server": AsynckvKVBootstrapServer}
"""The classes SGLang's ``get_kv_class`` returns for this backend, by ``KVClassType`` value
(``KVArgs`` is SGLang's own: the scheduler fills its attributes)."""
