"""Turn a core's ``Post`` (pages to pages) into a data-plane ``Write`` (handles of descriptors).

Pure numpy over the kernels; safe on a worker thread. Each handle is bounded by
``max_descs_per_xfer`` descriptors and ``xfer_handle_bytes`` bytes, so the data plane can
check the write lease between handles and no single copy runs long.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap

import numpy as np
import numpy.typing as npt

from ..config import Config
from ..errors import InvalidArgument
from ..kernels import (
    aux_descriptors,
    block_descriptors,
    handle_bounds,
    head_slice_descriptors,
    kv_page_descriptors,
    merge_contiguous,
    prepped_indices,
    prepped_pages_and_row,
    prepped_row,
    split_long,
)
from ..layout import KVArgs
from ..proto.actions import Post
from ..proto.registration import INT32_ROWS, POOL_RATIO
from ..proto.sender import DecodePeer
from ..proto.topology import PeerPlan
from ..transport.base import DescPiece, MemoryLayout, PreppedPiece, Write
from .staging import StagingArea, page_rows

__all__ = ["GATHER_INLINE_BYTES", "LANE_SPLIT_BYTES", "SCRATCH_BYTES", "WriteBuilder", "aux_rows", "dlist_rows"]

U64 = npt.NDArray[np.uint64]
log = logging.getLogger("asynckv.prefill")
SCRATCH_BYTES = 4096
LANE_SPLIT_BYTES = 8 << 20
"""A write at least this large is cut into one handle per write lane, which copy at once (a
handle's fixed cost is tens of microseconds; 8 MiB takes about 1.6 ms at 5 GB/s)."""
GATHER_INLINE_BYTES = 1 << 20
"""Gathers into the staging area larger than this run on a worker thread (~170 us at 6 GB/s,
against a ~90 us thread hop)."""
_FILL_PAGES = 1 << 16


def dlist_rows(ptrs: U64, strides: U64, lengths: U64, num_pages: int, dev: int, tail: U64 | None = None) -> U64:
    """One row per (entry, page), entry-major, as ``prepped_indices`` addresses them; then ``tail``.

    The rows (24 bytes each) are the only large allocation, in a mapping of their own that goes back
    to the OS once they are dropped, and they are filled in place a slice of pages at a time: built
    from malloc's heap with whole-entry temporaries, the rows of refused registrations stayed in
    worker threads' arenas (165 MiB after 90 refused claims of up to 1M pages)."""
    n = len(ptrs) * num_pages
    extra = 0 if tail is None else len(tail)
    whole = np.frombuffer(mmap.mmap(-1, max(1, (n + extra) * 24)), dtype=np.uint64, count=(n + extra) * 3)
    whole = whole.reshape(n + extra, 3)
    if tail is not None:
        whole[n:] = tail
    rows = whole[:n]
    steps = np.arange(min(num_pages, _FILL_PAGES), dtype=np.uint64)
    for e, (ptr, stride, length) in enumerate(zip(ptrs.tolist(), strides.tolist(), lengths.tolist(), strict=True)):
        for start in range(0, num_pages, _FILL_PAGES):
            block = rows[e * num_pages + start:e * num_pages + min(num_pages, start + _FILL_PAGES)]
            np.multiply(steps[:len(block)], np.uint64(stride), out=block[:, 0])
            block[:, 0] += np.uint64(ptr + stride * start)
            block[:, 1] = length
    rows[:, 2] = dev
    return whole


def aux_rows(ptrs: U64, items: U64, rows: int) -> U64:
    """One DRAM row per (aux buffer, row), buffer-major: row r of buffer b is row ``b * rows + r``
    (the layout of ``dlist_rows``, an aux row being a page of its buffer)."""
    return dlist_rows(ptrs, items, items, rows, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class _Peer:
    """A decode peer's geometry, as numpy arrays."""

    plan: PeerPlan
    mem_kind: str
    dev: int
    num_pages: int
    kv_ptrs: U64
    kv_items: U64
    aux_ptrs: U64
    state_ptrs: U64
    state_items: U64
    prepped: bool
    aux_base: int | None = None
    """Where the peer's aux rows start in its prepared dlist (None: its aux row goes as descriptors)."""
    aux_rows: int = 0


class WriteBuilder:
    """Descriptor math of one prefill rank towards its decode peers."""

    def __init__(self, kv_args: KVArgs, config: Config) -> None:
        a = self.args = kv_args
        self.config = config
        self.dev = a.gpu_id if a.mem_kind == "VRAM" else 0
        self.kv_ptrs, _, self.kv_items = a.kv_arrays()
        # Per-post constants.
        self._num_pages, self._num_entries = a.num_pages, a.num_entries
        self._page_bytes, self._max_item = int(self.kv_items.sum()), max(1, int(self.kv_items.max(initial=0)))
        self.aux_ptrs = np.asarray(a.aux_data_ptrs, dtype=np.uint64)
        self.aux_items = np.asarray(a.aux_item_lens, dtype=np.uint64)
        self.state_ptrs = np.asarray(a.state_data_ptrs, dtype=np.uint64)
        self.state_items = np.asarray(a.state_item_lens, dtype=np.uint64)
        self._aux_rows, self._aux_bytes = a.num_aux_rows, int(self.aux_items.sum())
        self._aux_base: int | None = None
        """Where our aux rows start in the prepared local dlist (None: aux rows go as descriptors)."""
        self._peers: dict[str, _Peer] = {}
        self.staging: StagingArea | None = None
        """Where head slices are gathered into whole pages (a prefill with DRAM KV; see ``staging``)."""
        self._kv_views: dict[int, npt.NDArray[np.uint8]] = {}

    def memory_layout(self, scratch: tuple[int, int], prepare_local: bool, keep: tuple[object, ...] = (),
                      extra_dram: tuple[tuple[int, int], ...] = ()) -> MemoryLayout:
        """KV and state in the rank's memory kind; aux, the scratch area and ``extra_dram`` (address, bytes:
        a decode's staging area) in DRAM. ``keep``: what owns that memory (the data plane holds it
        while registered, and until exit behind a transfer it cannot stop)."""
        a = self.args
        kv = np.array([[int(p), int(n), self.dev] for p, n in zip(
            [*a.kv_data_ptrs, *a.state_data_ptrs], [*a.kv_data_lens, *a.state_data_lens], strict=True)],
            dtype=np.uint64).reshape(-1, 3)
        if prepare_local and a.mem_kind == "DRAM" and self.config.staging_bytes > 0:
            self.staging = StagingArea(self.config.staging_bytes)
        staging = [[self.staging.addr, self.staging.capacity, 0]] if self.staging is not None else []
        dram = np.array([*([int(p), int(n), 0] for p, n in zip(a.aux_data_ptrs, a.aux_data_lens, strict=True)),
                         [scratch[0], scratch[1], 0], *staging, *([p, n, 0] for p, n in extra_dram)],
                        dtype=np.uint64).reshape(-1, 3)
        local = None
        if prepare_local and self.config.prepped_dlists:
            # DRAM KV: the aux rows join the prepared dlist, so an aux row is one prepared handle
            # (as descriptors it cost more than a KV page: built per post, ``initialize_xfer`` each time).
            tail = aux_rows(self.aux_ptrs, self.aux_items, self._aux_rows) if self._aux_preparable() else None
            local = dlist_rows(self.kv_ptrs, self.kv_items, self.kv_items, a.num_pages, self.dev, tail)
            if tail is not None:
                self._aux_base = len(self.kv_ptrs) * a.num_pages
        keep = (*keep, self.staging.buffer) if self.staging is not None else keep
        return MemoryLayout(((a.mem_kind, kv), ("DRAM", dram)), local, a.mem_kind, scratch, keep)

    def _aux_preparable(self) -> bool:
        a = self.args
        rows = a.num_entries * a.num_pages + len(self.aux_ptrs) * self._aux_rows
        return a.mem_kind == "DRAM" and len(self.aux_ptrs) > 0 and self._aux_rows > 0 and rows <= INT32_ROWS

    # -- peers --------------------------------------------------------------------------

    def add_peer(self, peer: DecodePeer) -> U64 | None:
        """Record a peer's geometry; returns its destination dlist rows when prepared dlists apply
        (one row per (entry, page): millions for a large pool, so call this off the event loop)."""
        reg = peer.reg
        geom = _Peer(plan=peer.plan, mem_kind=reg.mem_kind, dev=reg.gpu_id if reg.mem_kind == "VRAM" else 0,
                     num_pages=peer.num_pages, kv_ptrs=np.asarray(reg.kv_ptrs, dtype=np.uint64),
                     kv_items=np.asarray(reg.kv_item_lens, dtype=np.uint64),
                     aux_ptrs=np.asarray(reg.aux_ptrs, dtype=np.uint64),
                     state_ptrs=np.asarray(reg.state_ptrs, dtype=np.uint64),
                     state_items=np.asarray(reg.state_item_lens, dtype=np.uint64),
                     prepped=self.config.prepped_dlists and peer.plan.whole_pages and peer.pool_known)
        if not geom.prepped:
            self._peers[peer.name] = geom
            return None
        dst = peer.plan.dst_entries  # paired with local entries 0..n-1 in order
        kv_rows = len(dst) * geom.num_pages
        aux = peer.num_aux_rows
        # Its aux rows join its dlist when both sides hold them in DRAM and the claim is bounded as
        # pages are (a Register could claim millions of rows): at most POOL_RATIO times our own.
        tail = None
        if (self._aux_base is not None and geom.mem_kind == "DRAM" and 0 < aux <= POOL_RATIO * self._aux_rows
                and kv_rows + len(geom.aux_ptrs) * aux <= INT32_ROWS):
            tail = aux_rows(geom.aux_ptrs, self.aux_items, aux)
            geom = dataclasses.replace(geom, aux_base=kv_rows, aux_rows=aux)
        self._peers[peer.name] = geom
        return dlist_rows(geom.kv_ptrs[dst], geom.kv_items[dst], self.kv_items, geom.num_pages, geom.dev, tail)

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)

    # -- writes ----------------------------------------------------------------------------

    def descriptor_count(self, post: Post) -> int:
        """Descriptor rows (or prepared indices) ``build`` makes before merging, as each of its paths
        will (what decides whether it runs off the event loop): a head slice is one row per entry,
        page and token (page_size pieces per page), mamba blocks are per entry and block."""
        geom = self._peers.get(post.peer)
        if post.kind == "aux":
            return len(self.aux_ptrs)
        if geom is None:
            return 0  # build refuses it at once
        if post.kind == "kv":
            sliced = geom.plan.head_slice is not None
            aux = 0 if post.aux is None else len(self.aux_ptrs)
            return len(post.src) * len(geom.plan.src_entries) * (self.args.page_size if sliced else 1) + aux
        state = geom.plan.state
        if state is None:
            return 0
        if state.kind == "blocks" and state.blocks is not None:
            return len(state.src_entries) * int(state.blocks[2].shape[1])
        per_page = self.args.page_size if state.kind == "head_slice" else 1
        return len(post.src) * len(state.src_entries) * per_page

    def gather_bytes(self, post: Post) -> int:
        """Bytes ``build`` would gather into the staging area for ``post`` (0: none)."""
        geom = self._peers.get(post.peer)
        if post.kind != "kv" or geom is None or not self._stageable(geom):
            return 0
        return len(post.src) * int(geom.kv_items[geom.plan.dst_entries].sum())

    def build(self, post: Post) -> Write:
        """The write of ``post``; it may hold a staging run until ``release(post.post_id)``."""
        try:
            write = self._build(post)
        except BaseException:
            self.release(post.post_id)
            raise
        return dataclasses.replace(write, notif=post.notif) if post.notif else write

    def release(self, post_id: int, in_flight: bool = False) -> None:
        """The post settled (or was never posted): its staging run, if any, is free again, unless
        the post settled with a handle still ``in_flight``, which may still read it: then the run
        stays taken for good (quarantined; a peer stalled past the post's deadline, rare, logged)."""
        if self.staging is None:
            return
        if in_flight:
            if self.staging.quarantine(post_id):
                log.warning("post %d settled with a NIXL handle still reading its staging run; the run stays "
                            "taken (%d bytes of staging left)", post_id, self.staging.free_bytes)
            return
        self.staging.give(post_id)

    def _build(self, post: Post) -> Write:
        geom = self._peers.get(post.peer)
        if geom is None:
            raise KeyError(f"decode peer {post.peer[:8]} is not connected")
        if post.aux is not None and post.kind == "kv" and geom.aux_base is not None:
            one = self._one_handle_with_aux(geom, post, *post.aux)
            if one is not None:
                return one
        write = self._build_kind(geom, post)
        return write if post.aux is None else self._with_aux(write, geom, *post.aux)

    def _with_aux(self, write: Write, geom: _Peer, src_row: int, dst_row: int) -> Write:
        """``write``, then the aux row: in its last handle when both are prepared indices and that
        handle has room, in descriptors and bytes (a 1-page room is then one handle), else as a
        handle of its own."""
        aux = self._aux_write(geom, src_row, dst_row)
        last, first = write.pieces[-1], aux.pieces[0]
        if (len(aux.pieces) == 1 and isinstance(last, PreppedPiece) and isinstance(first, PreppedPiece)
                and len(last.src_idx) + len(first.src_idx) <= self.config.max_descs_per_xfer
                and len(last.src_idx) * self._max_item + aux.nbytes <= self._handle_bytes(write.nbytes)):
            joined = PreppedPiece(np.concatenate((last.src_idx, first.src_idx)),
                                  np.concatenate((last.dst_idx, first.dst_idx)))
            pieces = (*write.pieces[:-1], joined)
        else:
            pieces = (*write.pieces, *aux.pieces)
        return Write(pieces, write.descriptors + aux.descriptors, write.nbytes + aux.nbytes)

    def _one_handle_with_aux(self, geom: _Peer, post: Post, src_row: int, dst_row: int) -> Write | None:
        """What ``_with_aux(_build_kind(...))`` makes of a prepared KV post whose pages and aux row
        fit one handle, built in one pass (a 4-page post of 2 entries: 14 us the general way, 10 us this way);
        ``None`` for any other post, which takes the general way (and its errors)."""
        pages, aux = len(post.src), len(self.aux_ptrs)
        kv, nbytes = pages * self._num_entries, pages * self._page_bytes
        if not (geom.prepped and self._aux_base is not None and 0 < pages == len(post.dst) and 0 <= src_row <
                self._aux_rows and 0 <= dst_row < geom.aux_rows and kv + aux <= self.config.max_descs_per_xfer
                and kv * self._max_item + self._aux_bytes <= self._handle_bytes(nbytes)):
            return None
        src = prepped_pages_and_row(post.src, self._num_pages, self._num_entries, src_row, self._aux_rows, aux,
                                    self._aux_base)
        dst = prepped_pages_and_row(post.dst, geom.num_pages, self._num_entries, dst_row, geom.aux_rows, aux,
                                    geom.aux_base)  # type: ignore[arg-type]
        return Write((PreppedPiece(src, dst),), kv + aux, nbytes + self._aux_bytes)

    @property
    def aux_row_bytes(self) -> int:
        """Bytes of one aux row over every aux buffer."""
        return self._aux_bytes

    def _aux_write(self, geom: _Peer, src_row: int, dst_row: int) -> Write:
        if geom.aux_base is not None and self._aux_base is not None:
            return self._prepped_aux(geom, src_row, dst_row)
        src, dst = aux_descriptors(self.aux_ptrs, geom.aux_ptrs, self.aux_items, src_row, dst_row)
        return self._pieces(src, dst, "DRAM", "DRAM")

    def _build_kind(self, geom: _Peer, post: Post) -> Write:
        if post.kind == "kv" and geom.prepped:
            src_idx = prepped_indices(post.src, self._num_pages, self._num_entries)
            dst_idx = prepped_indices(post.dst, geom.num_pages, self._num_entries)
            nbytes = len(post.src) * self._page_bytes
            per = max(1, min(self.config.max_descs_per_xfer, self._handle_bytes(nbytes) // self._max_item))
            pieces = tuple(PreppedPiece(src_idx[i:i + per], dst_idx[i:i + per]) for i in range(0, len(src_idx), per))
            return Write(pieces, len(src_idx), nbytes)
        if post.kind == "kv":
            src, dst = self._kv_descs(geom, post)
        elif post.kind == "aux":
            return self._aux_write(geom, int(post.src[0]), int(post.dst[0]))
        else:
            src, dst = self._state_descs(geom, post)
        return self._pieces(src, dst, self.args.mem_kind, geom.mem_kind)

    def _prepped_aux(self, geom: _Peer, src_row: int, dst_row: int) -> Write:
        """Row ``src_row`` of every aux buffer into row ``dst_row``: one prepared index per buffer."""
        if not (0 <= src_row < self._aux_rows and 0 <= dst_row < geom.aux_rows) or geom.aux_base is None \
                or self._aux_base is None:
            raise InvalidArgument(f"aux rows {src_row} -> {dst_row} outside [0, {self._aux_rows}) -> "
                                  f"[0, {geom.aux_rows})")
        src = prepped_row(src_row, self._aux_rows, len(self.aux_ptrs), self._aux_base)
        dst = prepped_row(dst_row, geom.aux_rows, len(self.aux_ptrs), geom.aux_base)
        return Write((PreppedPiece(src, dst),), len(src), self._aux_bytes)

    def _handle_bytes(self, nbytes: int) -> int:
        """Bytes per handle for a write of ``nbytes``: at most ``xfer_handle_bytes``, and a share per
        write lane for a write of at least ``LANE_SPLIT_BYTES`` (its handles then copy at once)."""
        lanes = self.config.write_lanes
        if lanes < 2 or nbytes < LANE_SPLIT_BYTES:
            return self.config.xfer_handle_bytes
        return min(self.config.xfer_handle_bytes, -(-nbytes // lanes))

    def _pieces(self, src: U64, dst: U64, src_kind: str, dst_kind: str) -> Write:
        cfg = self.config
        handle = self._handle_bytes(int(src[:, 1].sum()) if len(src) else 0)
        src, dst = split_long(src, dst, handle)
        bounds = handle_bounds(src[:, 1], cfg.max_descs_per_xfer, handle)
        pieces = tuple(DescPiece(src[i:j], dst[i:j], src_kind, dst_kind) for i, j in bounds)
        return Write(pieces, len(src), int(src[:, 1].sum()) if len(src) else 0)

    def _kv_descs(self, geom: _Peer, post: Post) -> tuple[U64, U64]:
        plan = geom.plan
        args = (self.kv_ptrs[plan.src_entries], geom.kv_ptrs[plan.dst_entries], self.kv_items[plan.src_entries],
                geom.kv_items[plan.dst_entries])
        if plan.head_slice is None:
            return kv_page_descriptors(*args, post.src, post.dst, self.dev, geom.dev)
        staged = self._stage(geom, post) if self._stageable(geom) else None
        if staged is not None:
            return staged
        hs = plan.head_slice
        return head_slice_descriptors(*args, self.args.page_size, post.src, post.dst, hs.src_offs, hs.dst_offs,
                                      hs.nbytes, self.dev, geom.dev)

    # -- staging (see ``staging``) -----------------------------------------------------------

    def _stageable(self, geom: _Peer) -> bool:
        """A head slice that is the decode's whole token row: gathered, it is the decode's page."""
        hs = geom.plan.head_slice
        if self.staging is None or hs is None:
            return False
        dst_row = geom.kv_items[geom.plan.dst_entries] // np.uint64(self.args.page_size)
        return bool(np.all(hs.dst_offs == 0) and np.all(hs.nbytes == dst_row))

    def _kv_view(self, entry: int) -> npt.NDArray[np.uint8]:
        """Entry ``entry`` of our KV as (pages, page_size, token row bytes)."""
        view = self._kv_views.get(entry)
        if view is None:
            a = self.args
            view = self._kv_views[entry] = page_rows(int(self.kv_ptrs[entry]), int(self.kv_items[entry]),
                                                     a.num_pages, a.page_size)
        return view

    def _stage(self, geom: _Peer, post: Post) -> tuple[U64, U64] | None:
        """Gather the head slices of ``post`` into a staging run; its descriptors (one per entry
        and page, merged), or None when the area has no run that long (sent per token then)."""
        staging, plan, hs = self.staging, geom.plan, geom.plan.head_slice
        if staging is None or hs is None:  # (``_stageable`` said no already)
            return None
        dst_items = geom.kv_items[plan.dst_entries]
        pages = len(post.src)
        sizes = dst_items * np.uint64(pages)
        off = staging.take(post.post_id, int(sizes.sum()))
        if off is None:
            return None
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) + np.uint64(off)
        # Run by run of consecutive source pages: one strided copy each, in C without the GIL
        # (numpy's take would first copy the whole pool; fancy indexing copies twice; a Python
        # loop over pages took the GIL 2,048 times a request and crawled beside the engine threads).
        cut = np.flatnonzero(np.diff(post.src) != 1) + 1
        runs = list(zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [pages])).tolist(), strict=True))
        first = post.src.tolist()
        for e, entry in enumerate(plan.src_entries.tolist()):
            lo, n = int(hs.src_offs[e]), int(hs.nbytes[e])
            view = self._kv_view(entry)[:, :, lo:lo + n]
            start = int(starts[e])
            out = staging.buffer[start:start + int(sizes[e])].reshape(pages, self.args.page_size, n)
            for i, j in runs:
                out[i:j] = view[first[i]:first[i] + j - i]
        k = np.arange(pages, dtype=np.uint64)
        src = np.empty((len(sizes) * pages, 3), dtype=np.uint64)
        dst = np.empty_like(src)
        src[:, 0] = (np.uint64(staging.addr) + starts[:, None] + k[None, :] * dst_items[:, None]).ravel()
        dst[:, 0] = (geom.kv_ptrs[plan.dst_entries][:, None]
                     + post.dst.astype(np.uint64)[None, :] * dst_items[:, None]).ravel()
        src[:, 1] = dst[:, 1] = np.repeat(dst_items, pages)
        src[:, 2] = 0
        dst[:, 2] = geom.dev
        return merge_contiguous(src, dst)

    def _state_descs(self, geom: _Peer, post: Post) -> tuple[U64, U64]:
        plan = geom.plan.state
        if plan is None:
            raise KeyError("this peer takes no state")
        sp, si = self.state_ptrs[plan.src_entries], self.state_items[plan.src_entries]
        dp, di = geom.state_ptrs[plan.dst_entries], geom.state_items[plan.dst_entries]
        if plan.kind == "blocks" and plan.blocks is not None:
            return block_descriptors(sp, dp, si, di, int(post.src[0]), int(post.dst[0]), *plan.blocks, self.dev,
                                     geom.dev)
        if plan.kind == "head_slice" and plan.head_slice is not None:
            hs = plan.head_slice
            return head_slice_descriptors(sp, dp, si, di, self.args.page_size, post.src, post.dst, hs.src_offs,
                                          hs.dst_offs, hs.nbytes, self.dev, geom.dev)
        return kv_page_descriptors(sp, dp, si, di, post.src, post.dst, self.dev, geom.dev)
