"""Prefill: checking a decode's destination (``TransferInfo``) against what its peer registered.

Two steps, cheapest first. ``precheck_destination`` is O(1): array lengths against the
registered pages and state slots (a destination longer than the pool cannot be valid, and is
refused before anything is sorted), the aux row, the decode ranks of a room for the peer's TP
size, the prefix. ``check_destination_indices`` is the O(n log n) part: every index in range
and used once. A destination with at least ``Config.offload_min_descs`` indices is checked on
a worker thread: the core emits ``CheckDestination`` and is answered with
``destination_checked``; meanwhile it holds that peer's later messages, so messages of one
peer are still acted on in the order they came.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InvalidArgument
from ..kernels import check_pages
from .actions import Action
from .messages import Message, TransferInfo

__all__ = [
    "CheckDestination",
    "DestinationLimits",
    "check_destination_indices",
    "destination_indices",
    "footprint",
    "precheck_destination",
    "sender_of",
]


@dataclasses.dataclass(frozen=True, slots=True)
class DestinationLimits:
    """What a decode peer registered, as far as its destinations are concerned."""

    num_pages: int
    num_state_slots: int
    num_aux_rows: int
    required: int
    """How many decode ranks send each room's destination, for this peer's TP size and ours."""
    page_size: int


def destination_indices(info: TransferInfo) -> int:
    """Indices to check: what decides whether the check runs off the event loop."""
    return len(info.dst_pages) + len(info.dst_state_indices)


def precheck_destination(info: TransferInfo, limits: DestinationLimits) -> str | None:
    """Why a destination cannot be valid, found in O(1); None if it may be."""
    n, n_state = len(info.dst_pages), len(info.dst_state_indices)
    if n > limits.num_pages:
        return f"{n} destination pages, more than the {limits.num_pages} pages decode registered"
    if n_state > limits.num_state_slots:
        return f"{n_state} state indices, more than the {limits.num_state_slots} state slots decode registered"
    if info.aux_index != -1 and not 0 <= info.aux_index < limits.num_aux_rows:
        return f"decode aux_index {info.aux_index} outside [0, {limits.num_aux_rows})"
    if info.required_dst_info_num != limits.required:
        return (f"required_dst_info_num {info.required_dst_info_num} does not match the {limits.required} decode "
                f"ranks per room that decode's registered tp_size implies")
    if info.decode_prefix_len % limits.page_size:
        return f"decode_prefix_len {info.decode_prefix_len} is not a multiple of page_size {limits.page_size}"
    return None


def check_destination_indices(info: TransferInfo, limits: DestinationLimits) -> str | None:
    """Why a destination's indices are invalid (out of range, repeated); None if they are valid.
    Pure and thread-safe: it reads the message and the limits only."""
    try:
        check_pages(info.dst_pages, limits.num_pages, "decode destination pages")
        if len(info.dst_state_indices):
            check_pages(info.dst_state_indices, limits.num_state_slots, "decode state indices")
    except InvalidArgument as exc:
        return str(exc)
    return None


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class CheckDestination(Action):
    """Check a large destination's indices off the event loop (``run`` is pure), then answer
    ``destination_checked(token, reason)``; the core holds that peer's later messages until then."""

    token: int
    info: TransferInfo
    limits: DestinationLimits

    def run(self) -> str | None:
        return check_destination_indices(self.info, self.limits)


def sender_of(msg: Message) -> str | None:
    """The peer a message says it comes from (None for a message prefill does not expect)."""
    name: Any = getattr(msg, "decode_id", None) or getattr(msg, "sender_id", None)
    return name if isinstance(name, str) else None


def footprint(msg: Message) -> int:
    """About what keeping a decoded message costs: its strings, arrays and blobs, plus a record."""
    total = 256
    for name, kind in msg.SCHEMA:
        value = getattr(msg, name)
        if kind in ("str", "bytes"):
            total += len(value)
        elif kind == "i32":
            total += int(value.nbytes)
        elif kind == "ints":
            total += 8 * len(value)
        else:
            total += 8
    return total
