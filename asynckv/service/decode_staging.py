"""Decode's staging area: slots shaped like a prefill rank's pages, for ranks holding fewer heads.

The rules (which rooms take slots, when they are given back) are ``asynckv.proto.decode_staging``;
this is the memory. One DRAM buffer, registered with the rank's NIXL agent like its KV
(``np.empty``: address space until used). The first prefill TP larger than ours that registers
shapes it: a slot holds ``slot_heads`` heads of one page, half ours (the largest slice any larger
TP sends) where that TP's ranks' heads divide the half, else their own; slot ``k`` of entry ``e``
is ``item[e] * slot_heads / our_heads`` bytes at ``base[e] + k * that``, and the area holds
``capacity // sum(those)`` slots. A prefill whose ranks hold ``1/r`` of a slot's heads (``r`` whole)
is told the area is pages of its own size, ``r`` to a slot, and ``r`` of its TP ranks share a room's
slots, each a run of pages of its own (``part``): a room takes the bytes it would in slots of its
own shape. Ranks holding more heads than a slot, or a share that does not divide it (odd head
counts: TP3 after TP2 over 6 heads), are written per token, as without staging.

Which entries a rank writes is the prefill's business (pairing by layer id): before a room's
destination goes out, the first 16 bytes of each of its slots in every entry get a marker drawn
at random per area, and a slot whose marker is still there once every sender succeeded was not
written: it is not copied (a real token row equals the marker with probability 2^-128). An entry
a rank does not hold is skipped whole; a page it claimed but did not write keeps its contents, as
when written per token, never an earlier room's rows left in the slot. Above
``SCATTER_INLINE_BYTES`` each rank's slice is copied on a worker thread of its own (the slices are
other bytes of the same pages); slots are taken and given back on the loop only.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import LocalProtocolError
from ..layout import KVArgs
from ..proto.decode_staging import StagedSlice
from ..proto.topology import head_slice
from .staging import page_rows

if TYPE_CHECKING:
    from ..proto.bootstrap import PrefillRank

__all__ = ["DecodeStaging", "SCATTER_INLINE_BYTES"]

log = logging.getLogger("asynckv.decode")

I32 = npt.NDArray[np.int32]
U64 = npt.NDArray[np.uint64]
MARK = 16
"""Bytes of the unwritten-entry marker."""
SCATTER_INLINE_BYTES = 1 << 20
"""A room's staged bytes up to which the copy runs on the loop (a thread hop costs more)."""


def applies(a: KVArgs) -> bool:
    """Whether a decode rank with these buffers can stage: DRAM KV with heads to slice. (State is not
    staged: its entries go straight into ours, the Register naming our real rank for them.)"""
    return a.mem_kind == "DRAM" and not a.is_mla


class DecodeStaging:
    """The area, its slot allocator and the copy out of it (see the module docstring)."""

    def __init__(self, nbytes: int, args: KVArgs) -> None:
        self.buffer: npt.NDArray[np.uint8] = np.empty(max(nbytes, MARK), dtype=np.uint8)
        self.addr = int(self.buffer.ctypes.data)
        self.capacity = len(self.buffer)
        self.args = args
        self._items = np.asarray(args.kv_item_lens, dtype=np.uint64)
        self._marker = np.frombuffer(secrets.token_bytes(MARK), dtype=np.uint8)
        self.tp_prefill: int | None = None
        """The first prefill TP larger than ours that registered: it shaped the slots (None: not yet)."""
        self.slot_heads: int | None = None
        """The heads of one page a slot holds: half ours, or that TP's ranks' (``_shape_for``)."""
        self.slot_items = np.zeros(len(self._items), dtype=np.uint64)
        self._bases = np.zeros(len(self._items), dtype=np.uint64)
        """Offset of each entry's first slot in the buffer."""
        self._slots = 0
        self._free: list[tuple[int, int]] = []
        """Free runs of slots (start, length), sorted, never adjacent."""
        self._kv: dict[int, npt.NDArray[np.uint8]] = {}
        self._uniform: npt.NDArray[np.uint8] | None = None
        """The area as (entries, slots, slot bytes) where every entry's slot is one size."""

    # -- shape ---------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self._slots

    def usable(self, tp_prefill: int) -> bool:
        if self.slot_heads is None and not self._shape_for(tp_prefill):
            return False
        return self._per_slot(tp_prefill) is not None

    def _shape_for(self, tp_prefill: int) -> bool:
        """Shape the slots, once, when the first prefill TP larger than ours registers: half our heads
        (the largest slice a larger TP sends, so every larger TP whose ranks' heads divide it shares the
        slots: a room takes the same bytes of them as in slots of its own shape) where this TP's ranks'
        heads divide that half, else this TP's own slice. False (and unshaped) where staging cannot
        serve this TP: its ranks hold no fewer heads than ours, our items are not whole heads of whole
        pages, a page of its ranks would not cover a slot's marker, or not one slot fits."""
        a = self.args
        theirs, ours = self._heads(tp_prefill), a.kv_head_num
        if tp_prefill <= a.tp_size or ours <= theirs or not len(self._items) \
                or np.any(self._items % np.uint64(a.page_size * ours)):
            return False
        head = self._items // np.uint64(ours)  # (per entry: one head of one page)
        heads = ours // 2 if ours % 2 == 0 and (ours // 2) % theirs == 0 else theirs
        slot_items = head * np.uint64(heads)
        slots = self.capacity // int(slot_items.sum())
        if slots < 1 or int(head.min()) * theirs < MARK:
            return False
        self.tp_prefill, self.slot_heads, self.slot_items, self._slots = tp_prefill, heads, slot_items, slots
        self._bases = np.concatenate(([0], np.cumsum(slot_items[:-1] * np.uint64(slots)))).astype(np.uint64)
        self._free = [(0, slots)]
        item = int(slot_items[0])
        if np.all(slot_items == slot_items[0]):  # (the usual: K and V of every layer alike) one 3-d view
            self._uniform = self.buffer[:len(slot_items) * slots * item].reshape(len(slot_items), slots, item)
        return True

    def _heads(self, tp_prefill: int) -> int:
        """KV heads on a prefill rank at ``tp_prefill`` (ranks past the head count replicate one)."""
        return max(1, self.args.total_kv_head_num // tp_prefill)

    def _per_slot(self, tp_prefill: int) -> int | None:
        """How many pages of a ``tp_prefill`` rank one slot spans, or None where its pages do not fit a
        slot evenly: it holds more heads than the slot, or a share of them that does not divide it, or
        its page would not cover a slot's marker."""
        a = self.args
        if self.slot_heads is None or tp_prefill <= a.tp_size:
            return None
        theirs, shaped = self._heads(tp_prefill), self.slot_heads
        if theirs > shaped or shaped % theirs or int(self.slot_items.min()) // (shaped // theirs) < MARK:
            return None
        return shaped // theirs

    def _shape(self, tp_prefill: int) -> tuple[int, U64]:
        """``_per_slot(tp_prefill)`` and the page size of each entry a ``tp_prefill`` rank is told."""
        per_slot = self._per_slot(tp_prefill)
        if per_slot is None:
            raise LocalProtocolError(f"the decode staging area is not shaped for a prefill at TP {tp_prefill}")
        return per_slot, self.slot_items // np.uint64(per_slot)

    def register_fields(self, rank: PrefillRank) -> dict[str, Any]:
        """Our pool as a decode rank of ``rank``'s TP holding ``rank``'s heads would register it; our state
        entries as they are, split by our own rank (``state_tp_size``): the prefill writes them in place."""
        a, tp_prefill = self.args, rank.tp_size
        items = self._shape(tp_prefill)[1]
        return {"tp_size": tp_prefill, "engine_rank": rank.tp_rank, "kv_head_num": self._heads(tp_prefill),
                "kv_ptrs": tuple(int(x) for x in self._bases + np.uint64(self.addr)),
                "kv_lens": tuple(int(x) for x in self.slot_items * np.uint64(self._slots)),
                "kv_item_lens": tuple(int(x) for x in items),
                "state_tp_size": a.tp_size, "state_engine_rank": a.engine_rank, "state_head_num": a.kv_head_num}

    def per_slot(self, tp_prefill: int) -> int:
        return self._shape(tp_prefill)[0]

    def slice_of(self, rank: PrefillRank) -> tuple[U64, U64]:
        """Per entry: where in our token rows ``rank``'s rows go, and how many bytes they are."""
        a, tp_prefill = self.args, rank.tp_size
        hs = head_slice(tp_prefill=tp_prefill, tp_decode=a.tp_size, prefill_rank=rank.tp_rank,
                        decode_rank=a.engine_rank, total_heads=a.total_kv_head_num,
                        prefill_heads=self._heads(tp_prefill), decode_heads=a.kv_head_num,
                        page_size=a.page_size, src_items=self._shape(tp_prefill)[1], dst_items=self._items)
        return hs.dst_offs, hs.nbytes

    def part(self, rank: PrefillRank, slots: I32, sub: int) -> StagedSlice:
        """``rank``'s part of ``slots`` (taken for ``per_slot`` ranks of its TP, ``sub`` the rank's place
        among them), marked unwritten in every entry. Each run of ``L`` slots is ``L x per_slot`` pages
        of ``rank``'s size; rank ``sub`` gets the ``sub``-th block of ``L``: a run of its own (one
        descriptor a run on the prefill, one copy a run here)."""
        per_slot = self._shape(rank.tp_size)[0]
        if not 0 <= sub < per_slot:
            raise LocalProtocolError(f"rank {sub} of a slot that holds {per_slot} TP {rank.tp_size} ranks' pages")
        runs = np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1)
        blocks = [np.arange(int(run[0]) * per_slot + sub * len(run), int(run[0]) * per_slot + (sub + 1) * len(run),
                            dtype=np.int32) for run in runs if len(run)]
        indices = blocks[0] if len(blocks) == 1 else np.concatenate(blocks) if blocks else slots
        dst_offs, nbytes = self.slice_of(rank)
        part = StagedSlice(rank.agent_id, slots, dst_offs, nbytes, indices, sub)
        view = self._mark_view(part)
        if view is not None:
            view[...] = self._marker
        else:
            self.buffer[self._marks(part)] = self._marker
        return part

    # -- slots ---------------------------------------------------------------------------

    def take(self, n: int) -> I32 | None:
        """``n`` slots, from the lowest free runs (contiguous where they can be: a run of pages is one
        descriptor); None when fewer are free."""
        if n <= 0 or sum(length for _, length in self._free) < n:
            return None
        parts, left = [], n
        while left:
            start, length = self._free[0]
            got = min(length, left)
            parts.append(np.arange(start, start + got, dtype=np.int32))
            if got == length:
                del self._free[0]
            else:
                self._free[0] = (start + got, length - got)
            left -= got
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def give(self, slots: I32) -> None:
        runs = np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1)
        free = self._free + [(int(r[0]), len(r)) for r in runs if len(r)]
        free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self._free)

    def _mark_view(self, part: StagedSlice) -> npt.NDArray[np.uint8] | None:
        """The markers of ``part`` in every entry, (entries, pages, MARK), as a view where its pages are
        one run (slots taken lowest first: the usual) and the entries one size; else None."""
        idx = part.indices
        if self._uniform is None or not len(idx) or int(idx[-1]) - int(idx[0]) != len(idx) - 1:
            return None
        entries, slots, item = self._uniform.shape
        page = self.args.page_size * int(part.nbytes[0])
        i0 = int(idx[0])
        return self._uniform.reshape(entries, slots * item // page, page)[:, i0:i0 + len(idx), :MARK]

    def _read_marks(self, part: StagedSlice) -> npt.NDArray[np.uint8]:
        view = self._mark_view(part)
        return view if view is not None else self.buffer[self._marks(part)]

    def _marks(self, part: StagedSlice) -> npt.NDArray[np.intp]:
        """Buffer indices of ``part``'s markers in every entry: shape (entries, pages, MARK)."""
        page = part.nbytes * np.uint64(self.args.page_size)  # (per entry: the size of its pages)
        first = self._bases[:, None] + part.indices.astype(np.uint64)[None, :] * page[:, None]
        return first.astype(np.intp)[:, :, None] + np.arange(MARK, dtype=np.intp)

    # -- the copy ------------------------------------------------------------------------

    def nbytes(self, slices: tuple[StagedSlice, ...]) -> int:
        """Bytes ``scatter`` copies at most."""
        return sum(len(s.slots) * int(s.nbytes.sum()) for s in slices) * self.args.page_size

    def scatter(self, pages: I32, slices: tuple[StagedSlice, ...]) -> int:
        """Copy each slice's pages into ``pages`` (its ``k``-th into page ``pages[k]``); entries a rank did
        not write are left alone. Returns the entries copied."""
        a, copied = self.args, 0
        for part in slices:
            if not len(part.slots):
                continue
            written = ~np.all(self._read_marks(part) == self._marker, axis=2)  # (entries, slots)
            whole = written.all(axis=1)
            partial = written.any(axis=1) & ~whole
            if partial.any():  # it said it wrote them all: the pages of slots it left keep their contents
                log.warning("prefill %s left staged pages unwritten in %d entries (%d pages in all); those pages "
                            "are not copied", part.agent_id[:8], int(partial.sum()), int((~written[partial]).sum()))
            moves = _moves(part.indices, pages)
            for e in np.flatnonzero(written.any(axis=1)).tolist():
                n, lo = int(part.nbytes[e]), int(part.dst_offs[e])
                base, size = int(self._bases[e]), int(self.slot_items[e]) * self._slots
                stage = self.buffer[base:base + size].reshape(-1, a.page_size, n)  # (pages of the rank's size)
                kv = self._kv_view(e)
                if whole[e]:
                    for s0, count, dst in moves:
                        kv[dst, :, lo:lo + n] = stage[s0:s0 + count]
                else:  # (as per token: what was not written keeps its contents)
                    got = written[e]
                    kv[pages[got], :, lo:lo + n] = stage[part.indices[got]]
                copied += 1
        return copied

    def _kv_view(self, entry: int) -> npt.NDArray[np.uint8]:
        """Entry ``entry`` of our KV as (pages, page_size, token row bytes)."""
        view = self._kv.get(entry)
        if view is None:
            a = self.args
            item = int(a.kv_item_lens[entry])
            view = self._kv[entry] = page_rows(int(a.kv_data_ptrs[entry]), item, int(a.kv_data_lens[entry]) // item,
                                               a.page_size)
        return view


def _moves(slots: I32, pages: I32) -> list[tuple[int, int, slice | I32]]:
    """The copies of one rank's staged pages (``slots``), the same for every entry: per run of
    consecutive ones (taken in runs: usually one), its first, its length and its pages (a slice where
    they run on too: it copies faster than an index array)."""
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    bounds = [0, *cut.tolist(), len(slots)]
    moves: list[tuple[int, int, slice | I32]] = []
    for i, j in itertools.pairwise(bounds):
        p0 = int(pages[i])
        dst = slice(p0, p0 + j - i) if j - i == 1 or bool(np.all(np.diff(pages[i:j]) == 1)) else pages[i:j]
        moves.append((int(slots[i]), j - i, dst))
    return moves
