"""The staging area's allocator: runs taken per post, given back and merged, never overlapping."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from asynckv.service.staging import StagingArea


def test_runs_are_aligned_first_fit_and_given_back_whole() -> None:
    area = StagingArea(1024)
    assert [area.take(i, 100) for i in range(3)] == [0, 128, 256]  # 64-byte aligned
    assert area.take(3, 1024) is None and area.held == 3  # no run that long: the caller sends per token
    area.give(1)
    assert area.take(4, 128) == 128  # the hole is reused
    for post in (0, 2, 4):
        area.give(post)
    assert area.free_bytes == 1024 and area.held == 0 and area.take(5, 1024) == 0


def test_a_post_holds_one_run_and_giving_an_unknown_post_is_harmless() -> None:
    area = StagingArea(256)
    area.take(1, 64)
    with pytest.raises(ValueError, match="holds a staging run"):
        area.take(1, 64)
    area.give(99)
    area.give(1)
    area.give(1)  # (a post settles once, but a second give must not free someone else's run)
    assert area.free_bytes == 256


@pytest.mark.parametrize("seed", range(20))
def test_random_take_and_give_never_overlap_and_merge_back_to_one_run(seed: int) -> None:
    rng = np.random.default_rng(seed)
    area = StagingArea(64 * 100)
    held: dict[int, tuple[int, int]] = {}
    ids = itertools.count()
    for _ in range(300):
        if held and rng.random() < 0.5:
            post = int(rng.choice(list(held)))
            del held[post]
            area.give(post)
        else:
            post, n = next(ids), int(rng.integers(1, 64 * 20))
            off = area.take(post, n)
            if off is not None:
                held[post] = (off, -(-n // 64) * 64)
        runs = sorted(held.values())
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(runs))
        assert all(off + n <= area.capacity for off, n in runs)
        assert area.free_bytes == area.capacity - sum(n for _, n in runs)
    for post in list(held):
        area.give(post)
    assert area._free == [(0, area.capacity)]


def test_a_quarantined_run_is_never_handed_out_again() -> None:
    area = StagingArea(256)
    assert area.take(1, 128) == 0 and area.take(2, 128) == 128
    assert area.quarantine(1) and not area.quarantine(1)
    area.give(1)  # (a late give of a quarantined post frees nothing)
    area.give(2)
    assert area.quarantined == 128 and area.free_bytes == 128 and area.take(3, 256) is None
    assert area.take(4, 128) == 128


def test_the_builder_quarantines_the_run_of_a_post_whose_handle_is_still_in_flight() -> None:
    from asynckv.config import Config
    from asynckv.service.writes import WriteBuilder
    from asynckv.testing import KVPool

    builder = WriteBuilder(KVPool(2, 8, 256).kv_args(4), Config(staging_bytes=4096))
    builder.memory_layout((0x9000, 64), prepare_local=True)
    staging = builder.staging
    assert staging is not None
    staging.take(1, 1024)
    staging.take(2, 1024)
    builder.release(1, in_flight=True)
    builder.release(2)
    assert staging.quarantined == 1024 and staging.free_bytes == 4096 - 1024 and staging.held == 0
