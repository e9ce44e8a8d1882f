"""Deterministic page contents keyed by (room, entry, page position), verifiable anywhere.

Every 8-byte word of page ``j`` of entry ``e`` of room ``r`` holds
``mix(r, e, j) ^ word_index``: a page copied to the wrong place, a shifted offset or a
page from another room all show up as mismatches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

from ..layout import KVArgs

__all__ = ["KVPool", "Request", "fill_aux", "fill_pages", "make_plan", "verify_aux", "verify_pages"]

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def _mix(room: int, entries: npt.NDArray[np.uint64], positions: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64-style hash of (room, entry, position), shape (entries, positions)."""
    with np.errstate(over="ignore"):
        x = (np.uint64(room & 0xFFFFFFFFFFFFFFFF) * _M1 + entries[:, None] * _M2 + positions[None, :] * _M3
             + np.uint64(1))
        x ^= x >> np.uint64(31)
        x *= _M2
        x ^= x >> np.uint64(29)
    return x


@dataclasses.dataclass
class KVPool:
    """A KV pool in DRAM: ``entries`` buffers of ``num_pages`` pages of ``item_bytes`` each, plus aux rows."""

    entries: int
    num_pages: int
    item_bytes: int
    aux_rows: int = 16
    aux_item_bytes: int = 64
    aux_buffers: int = 2

    def __post_init__(self) -> None:
        if self.item_bytes % 8 or self.aux_item_bytes % 8:
            raise ValueError("item sizes must be multiples of 8 bytes")
        self.kv = np.zeros((self.entries, self.num_pages, self.item_bytes // 8), dtype=np.uint64)
        self.aux = [np.zeros((self.aux_rows, self.aux_item_bytes // 8), dtype=np.uint64)
                    for _ in range(self.aux_buffers)]

    def kv_args(self, page_size: int = 16, **fields: Any) -> KVArgs:
        return KVArgs.from_arrays(self.kv, page_size=page_size, aux=self.aux, **fields)

    @property
    def page_bytes(self) -> int:
        return self.entries * self.item_bytes


def fill_pages(pool: KVPool, room: int, pages: Any, first_position: int = 0) -> None:
    """Write room ``room``'s pattern for positions ``first_position..`` into ``pages``."""
    pages = np.asarray(pages, dtype=np.int64)
    pos = np.arange(first_position, first_position + len(pages), dtype=np.uint64)
    base = _mix(room, np.arange(pool.entries, dtype=np.uint64), pos)
    words = np.arange(pool.kv.shape[2], dtype=np.uint64)
    for e in range(pool.entries):  # one entry at a time: small temporaries, no page-fault storm
        pool.kv[e, pages, :] = base[e, :, None] ^ words[None, :]


def verify_pages(pool: KVPool, room: int, pages: Any, first_position: int = 0) -> int:
    """Count the pages (over all entries) that do not hold room ``room``'s pattern."""
    pages = np.asarray(pages, dtype=np.int64)
    if len(pages) == 0:
        return 0
    pos = np.arange(first_position, first_position + len(pages), dtype=np.uint64)
    base = _mix(room, np.arange(pool.entries, dtype=np.uint64), pos)
    words = np.arange(pool.kv.shape[2], dtype=np.uint64)
    bad = 0
    for e in range(pool.entries):
        got = pool.kv[e, pages, :]
        got ^= words[None, :]
        bad += int((got != base[e, :, None]).any(axis=1).sum())
    return bad


def fill_aux(pool: KVPool, room: int, row: int) -> None:
    words = np.arange(pool.aux_item_bytes // 8, dtype=np.uint64)
    for i, buf in enumerate(pool.aux):
        buf[row] = _mix(room, np.array([1000 + i], dtype=np.uint64), np.array([0], dtype=np.uint64))[0, 0] ^ words


def verify_aux(pool: KVPool, room: int, row: int) -> int:
    """Count aux buffers whose row ``row`` does not hold room ``room``'s metadata."""
    words = np.arange(pool.aux_item_bytes // 8, dtype=np.uint64)
    bad = 0
    for i, buf in enumerate(pool.aux):
        want = _mix(room, np.array([1000 + i], dtype=np.uint64), np.array([0], dtype=np.uint64))[0, 0] ^ words
        bad += int(not np.array_equal(buf[row], want))
    return bad


@dataclasses.dataclass(frozen=True)
class Request:
    room: int
    num_pages: int


def make_plan(seed: int, count: int, min_pages: int, max_pages: int) -> list[Request]:
    """A reproducible stream of requests of mixed lengths with distinct random room ids."""
    rng = np.random.default_rng(seed)
    rooms: set[int] = set()
    plan: list[Request] = []
    while len(plan) < count:
        room = int(rng.integers(1, 2**63 - 1))
        if room in rooms:
            continue
        rooms.add(room)
        plan.append(Request(room, int(rng.integers(min_pages, max_pages + 1))))
    return plan
