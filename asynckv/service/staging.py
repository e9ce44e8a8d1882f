"""The prefill's staging area: where head slices are gathered into whole pages before a write.

A decode rank at a larger TP than ours holds fewer heads per token: it wants, of every token
row of every page, the slice of its heads. Sent in place that is one NIXL descriptor per
token (page_size per page and entry), and descriptors cost about 4 us each at post time on
CMA: TP1 -> TP2 moved 0.17x the GB/s of TP1 -> TP1 on the same bytes. When the slice is the
decode's whole token row (that is, whenever the decode holds fewer heads), the sliced page
is exactly the decode's page: gathered here (numpy, page by page, ~6 GB/s on one core) it
goes out as one descriptor per page.

The area is one DRAM buffer registered with the rank's memory (``np.empty``: untouched, it
costs address space only). A write takes a run of it while it is built and gives it back when
its post settles (a post that settles past its deadline with its handle still in flight
leaves its run taken for good: that handle may still read it); a write that finds no room
(or a rank whose KV is not DRAM) is sent in place, per token, as before. Safe from the loop
and from build threads at once.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import numpy.typing as npt

__all__ = ["StagingArea", "page_rows"]


def page_rows(ptr: int, item_bytes: int, pages: int, page_size: int) -> npt.NDArray[np.uint8]:
    """The KV entry at ``ptr`` (``pages`` pages of ``item_bytes``) as (pages, page_size, token row
    bytes): a view of that memory, no copy, for the strided copies into and out of staging."""
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * (item_bytes * pages)).from_address(ptr))
    return raw.reshape(pages, page_size, -1)


class StagingArea:
    """A buffer and a first-fit allocator of byte runs over it, keyed by post id."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.buffer: npt.NDArray[np.uint8] = np.empty(max(nbytes, self.ALIGN), dtype=np.uint8)
        self.addr = int(self.buffer.ctypes.data)
        self.capacity = len(self.buffer)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]
        """Free runs (offset, length), sorted by offset, never adjacent."""
        self._taken: dict[int, tuple[int, int]] = {}
        """post id -> its run."""
        self._lock = threading.Lock()
        self.quarantined = 0
        """Bytes of runs kept for good (their post settled with a handle still in flight)."""

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    @property
    def held(self) -> int:
        """Posts holding a run."""
        return len(self._taken)

    def take(self, post_id: int, nbytes: int) -> int | None:
        """The offset of a run of ``nbytes`` for ``post_id``, or None when no run is that long."""
        need = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            if post_id in self._taken:
                raise ValueError(f"post {post_id} holds a staging run already")
            for i, (off, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, length - need)
                    self._taken[post_id] = (off, need)
                    return off
        return None

    def quarantine(self, post_id: int) -> bool:
        """Keep ``post_id``'s run taken for good (a NIXL handle may still read it); True if it held one."""
        with self._lock:
            run = self._taken.pop(post_id, None)
            if run is not None:
                self.quarantined += run[1]
            return run is not None

    def give(self, post_id: int) -> None:
        """Return ``post_id``'s run, if it holds one (merged with its free neighbours)."""
        with self._lock:
            run = self._taken.pop(post_id, None)
            if run is None:
                return
            off, length = run
            free = self._free
            i = next((k for k, (o, _) in enumerate(free) if o > off), len(free))
            if i < len(free) and off + length == free[i][0]:
                length += free[i][1]
                del free[i]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == off:
                off, length = free[i - 1][0], free[i - 1][1] + length
                i -= 1
                del free[i]
            free.insert(i, (off, length))
