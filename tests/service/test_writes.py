"""The write builder's aux rows: with DRAM KV they join the prepared dlists, and a prepared aux
write must address exactly the rows the descriptor path would write."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynckv.config import Config
from asynckv.errors import InvalidArgument
from asynckv.kernels import aux_descriptors
from asynckv.proto.actions import Post
from asynckv.proto.messages import Register
from asynckv.proto.sender import DecodePeer
from asynckv.proto.topology import plan_peer, stub_agent_metadata
from asynckv.service.writes import WriteBuilder
from asynckv.testing import KVPool
from asynckv.transport.base import DescPiece, PreppedPiece, Write


def register(pool: KVPool) -> Register:
    d = pool.kv_args(4)
    return Register(
        decode_id="decode", prefill_id="prefill", session=1, lease_ms=3000, endpoint="tcp://127.0.0.1:5000",
        engine_rank=0, tp_size=1, page_size=4, kv_dtype=d.kv_dtype, mem_kind="DRAM", is_mla=False, gpu_id=0,
        kv_ptrs=tuple(d.kv_data_ptrs), kv_lens=tuple(d.kv_data_lens), kv_item_lens=tuple(d.kv_item_lens),
        kv_layer_ids=d.layer_ids, aux_ptrs=tuple(d.aux_data_ptrs), aux_lens=tuple(d.aux_data_lens),
        aux_item_lens=tuple(d.aux_item_lens), scratch_ptr=0x1000, scratch_len=4096, kv_head_num=d.kv_head_num,
        total_kv_head_num=d.total_kv_head_num, state_type="none", state_ptrs=(), state_lens=(), state_item_lens=(),
        state_layer_ids=(), state_dims=(), state_outer=(), agent_metadata=stub_agent_metadata("decode"))


def connected(decode_aux_rows: int, prepped: bool = True) -> tuple[WriteBuilder, np.ndarray, np.ndarray | None]:
    """A builder for a prefill pool (16 aux rows), its local rows, and the rows of a decode peer."""
    local = KVPool(2, 8, 256).kv_args(4)
    builder = WriteBuilder(local, Config(prepped_dlists=prepped, staging_bytes=0))
    layout = builder.memory_layout((0x9000, 64), prepare_local=True)
    reg = register(KVPool(2, 32, 256, aux_rows=decode_aux_rows))
    peer = DecodePeer.from_register(reg, plan_peer(local, reg), 0.0, 10.0)
    rows = builder.add_peer(peer)
    return builder, (layout.local_rows if layout.local_rows is not None else np.empty((0, 3))), rows


def aux_post(src: int, dst: int) -> Post:
    return Post(1, "decode", 7, 1, "aux", np.array([src]), np.array([dst]), 128, 5.0)


@pytest.mark.parametrize(("src", "dst"), [(0, 0), (3, 5), (15, 31)])
def test_a_prepared_aux_write_addresses_the_rows_the_descriptors_would(src: int, dst: int) -> None:
    builder, local, remote = connected(decode_aux_rows=32)
    assert remote is not None
    write = builder.build(aux_post(src, dst))
    (piece,) = write.pieces
    assert isinstance(piece, PreppedPiece) and write.nbytes == 2 * 64 and write.descriptors == 2
    peer = builder._peers["decode"]
    want_src, want_dst = aux_descriptors(builder.aux_ptrs, peer.aux_ptrs, builder.aux_items, src, dst)
    assert np.array_equal(local[piece.src_idx], want_src)
    assert np.array_equal(remote[piece.dst_idx], want_dst)
    # The KV rows keep their indices: the aux rows come after them.
    assert len(local) == 2 * 8 + 2 * 16 and len(remote) == 2 * 32 + 2 * 32


def test_an_aux_claim_beyond_four_times_ours_goes_as_descriptors_and_builds_no_rows_for_it() -> None:
    builder, _, remote = connected(decode_aux_rows=16 * 4 + 1)
    assert remote is not None and len(remote) == 2 * 32  # KV rows only
    (piece,) = builder.build(aux_post(3, 64)).pieces
    assert isinstance(piece, DescPiece)


def test_without_prepared_dlists_aux_rows_go_as_descriptors() -> None:
    builder, local, remote = connected(decode_aux_rows=16, prepped=False)
    assert remote is None and len(local) == 0
    (piece,) = builder.build(aux_post(3, 5)).pieces
    assert isinstance(piece, DescPiece)


def test_a_prepared_aux_row_out_of_range_is_refused_not_sent_to_a_neighbour() -> None:
    builder, _, _ = connected(decode_aux_rows=16)
    for src, dst in ((16, 0), (0, 16), (-1, 0)):
        with pytest.raises(InvalidArgument, match="aux rows"):
            builder.build(aux_post(src, dst))


def kv_post(src: list[int], dst: list[int], aux: tuple[int, int] | None) -> Post:
    return Post(2, "decode", 7, 1, "kv", np.array(src), np.array(dst), 256 * 2 * len(src), 5.0, aux=aux)


def test_the_aux_row_riding_on_a_kv_post_joins_its_last_handle_at_the_rows_the_aux_post_would_write() -> None:
    builder, _, remote = connected(decode_aux_rows=32)
    assert remote is not None
    alone, riding = builder.build(kv_post([1, 2], [7, 9], None)), builder.build(kv_post([1, 2], [7, 9], (3, 5)))
    aux = builder.build(aux_post(3, 5))
    (kv_piece,), (aux_piece,), (piece,) = alone.pieces, aux.pieces, riding.pieces
    assert (isinstance(piece, PreppedPiece) and isinstance(kv_piece, PreppedPiece)
            and isinstance(aux_piece, PreppedPiece))
    assert piece.src_idx.tolist() == kv_piece.src_idx.tolist() + aux_piece.src_idx.tolist()
    assert piece.dst_idx.tolist() == kv_piece.dst_idx.tolist() + aux_piece.dst_idx.tolist()
    assert (riding.nbytes, riding.descriptors) == (alone.nbytes + aux.nbytes, alone.descriptors + aux.descriptors)
    assert builder.descriptor_count(kv_post([1, 2], [7, 9], (3, 5))) == alone.descriptors + 2


def test_the_aux_row_goes_as_a_handle_of_its_own_when_the_last_one_is_full_or_not_prepared() -> None:
    builder, _, _ = connected(decode_aux_rows=32)
    builder.config = Config(prepped_dlists=True, staging_bytes=0, max_descs_per_xfer=4)
    full = builder.build(kv_post([1, 2], [7, 9], (3, 5)))  # 2 pages x 2 entries: the handle is full
    assert [len(p.src_idx) for p in full.pieces if isinstance(p, PreppedPiece)] == [4, 2]
    builder, _, _ = connected(decode_aux_rows=16 * 4 + 1)  # aux rows not prepared: descriptors after the pages
    last = builder.build(kv_post([1], [7], (3, 64))).pieces
    assert isinstance(last[0], PreppedPiece) and isinstance(last[-1], DescPiece) and len(last) == 2


def test_the_aux_row_joins_the_last_handle_only_within_its_byte_bound() -> None:
    builder, local, _ = connected(decode_aux_rows=32)
    builder.config = Config(prepped_dlists=True, staging_bytes=0, xfer_handle_bytes=512)  # one page a handle
    write = builder.build(kv_post([1, 2], [7, 9], (3, 5)))
    sizes = [int(local[p.src_idx][:, 1].sum()) for p in write.pieces if isinstance(p, PreppedPiece)]
    assert sizes == [512, 512, 128]  # two pages, then the aux row alone: no handle past 512 bytes


def _general(builder: WriteBuilder, post: Post) -> Write:
    """The general way, step by step (what the one-pass build of a small post with its aux row must equal)."""
    geom = builder._peers[post.peer]
    assert post.aux is not None
    return builder._with_aux(builder._build_kind(geom, post), geom, *post.aux)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([(None, None), (4, None), (5, None), (None, 512), (None, 640), (3, 256)]))
def test_a_small_post_with_its_aux_row_is_built_in_one_pass_as_the_general_way_builds_it(
        data: st.DataObject, bounds: tuple[int | None, int | None]) -> None:
    builder, _, _ = connected(decode_aux_rows=32)
    descs, handle = bounds
    limits: dict[str, Any] = {**({"max_descs_per_xfer": descs} if descs else {}),
                              **({"xfer_handle_bytes": handle} if handle else {})}
    builder.config = Config(prepped_dlists=True, staging_bytes=0, **limits)
    n = data.draw(st.integers(1, 8))
    src, dst = data.draw(st.permutations(range(8)))[:n], data.draw(st.permutations(range(32)))[:n]
    aux = (data.draw(st.integers(0, 15)), data.draw(st.integers(0, 31)))
    post = kv_post(list(src), list(dst), aux)
    one = builder._one_handle_with_aux(builder._peers["decode"], post, *aux)
    built, general = builder.build(post), _general(builder, post)
    assert (built.descriptors, built.nbytes, len(built.pieces)) == (general.descriptors, general.nbytes,
                                                                    len(general.pieces))
    for mine, theirs in zip(built.pieces, general.pieces, strict=True):
        assert type(mine) is type(theirs)
        if isinstance(mine, PreppedPiece) and isinstance(theirs, PreppedPiece):
            assert mine.src_idx.dtype == theirs.src_idx.dtype == np.int32
            assert mine.src_idx.tolist() == theirs.src_idx.tolist()
            assert mine.dst_idx.tolist() == theirs.dst_idx.tolist()
    fits = n * 2 + 2 <= builder.config.max_descs_per_xfer and n * 2 * 256 + 128 <= builder.config.xfer_handle_bytes
    assert (one is not None) == fits  # (the one pass serves exactly the posts that make one handle)


def test_a_small_post_whose_aux_row_is_out_of_range_is_refused_as_before() -> None:
    builder, _, _ = connected(decode_aux_rows=16)
    for aux in ((16, 0), (0, 16), (-1, 0)):
        assert builder._one_handle_with_aux(builder._peers["decode"], kv_post([1], [2], aux), *aux) is None
        with pytest.raises(InvalidArgument, match="aux rows"):
            builder.build(kv_post([1], [2], aux))
