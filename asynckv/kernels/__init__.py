"""Pure numpy descriptor math: arrays in, arrays out, no I/O.

Every kernel has a slow, obviously correct twin in ``asynckv.kernels._reference`` that
the tests compare it with.
"""

from .pages import (
    aux_descriptors,
    check_pages,
    coalesce_runs,
    handle_bounds,
    kv_page_descriptors,
    prepped_indices,
    prepped_pages_and_row,
    prepped_row,
    split_long,
    validate_pages,
)
from .slicing import block_descriptors, head_slice_descriptors, merge_contiguous

__all__ = [
    "aux_descriptors",
    "block_descriptors",
    "check_pages",
    "head_slice_descriptors",
    "merge_contiguous",
    "coalesce_runs",
    "handle_bounds",
    "kv_page_descriptors",
    "prepped_indices",
    "prepped_pages_and_row",
    "prepped_row",
    "split_long",
    "validate_pages",
]
