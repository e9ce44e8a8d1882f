"""SGLang 0.5.10's NIXL wire, as its connector builds it (frames assembled here exactly the way
``NixlKVReceiver._register_kv_args`` and ``init`` do), decoded and re-encoded byte for byte."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from asynckv.errors import RemoteProtocolError
from asynckv.proto.sglang import (
    GUARD,
    SglangCompletion,
    SglangRegister,
    SglangTransferInfo,
    aux_notification,
    decode_frames,
    kv_notification,
    parse_notification,
    state_notification,
)
from asynckv.proto.topology import stub_agent_metadata

NAME = "3f2b6c1e-8a4d-4e0f-9b7a-2c5d1e6f7a80"


def sglang_register(kv_ptrs: list[int], aux_ptrs: list[int]) -> list[bytes]:
    """What SGLang 0.5.10's decode sends once per prefill rank (``_register_kv_args``)."""
    return [GUARD, "None".encode("ascii"), "127.0.0.1".encode("ascii"), str(42577).encode("ascii"),
            NAME.encode("ascii"), stub_agent_metadata(NAME), b"".join(struct.pack("Q", p) for p in kv_ptrs),
            b"".join(struct.pack("Q", p) for p in aux_ptrs), b"", str(0).encode("ascii"),
            str(1).encode("ascii"), str(0).encode("ascii"), str(256).encode("ascii")]


def sglang_transfer_info(room: int, pages: np.ndarray, aux: int) -> list[bytes]:
    """What SGLang 0.5.10's decode sends per room (``NixlKVReceiver.init``)."""
    return [GUARD, str(room).encode("ascii"), "127.0.0.1".encode("ascii"), str(42577).encode("ascii"),
            NAME.encode("ascii"), pages.tobytes(), str(aux).encode("ascii"), str(1).encode("ascii"), b""]


def test_a_registration_decodes_and_encodes_back_byte_for_byte() -> None:
    frames = sglang_register([0x7F00_0000_0000 + i * 4096 for i in range(6)], [0x7E00_0000_0000 + i for i in range(10)])
    reg = decode_frames(frames)
    assert isinstance(reg, SglangRegister)
    assert reg.endpoint == "tcp://127.0.0.1:42577" and reg.agent_name == NAME and reg.kv_item_len == 256
    assert reg.kv_ptrs[5] == 0x7F00_0000_0000 + 5 * 4096 and len(reg.aux_ptrs) == 10 and reg.state_ptrs == ()
    assert (reg.gpu_id, reg.tp_size, reg.engine_rank) == (0, 1, 0)
    assert reg.encode() == frames


def test_a_transfer_info_decodes_and_encodes_back_byte_for_byte() -> None:
    pages = np.array([9, 3, 17, 4], dtype=np.int32)
    frames = sglang_transfer_info(4535838703865032264, pages, 15)
    info = decode_frames(frames)
    assert isinstance(info, SglangTransferInfo)
    assert info.room == 4535838703865032264 and info.aux_index == 15 and info.required_dst_info_num == 1
    assert np.array_equal(info.dst_pages, pages) and not info.is_dummy and info.state_indices.size == 0
    assert info.encode() == frames
    dummy = decode_frames(sglang_transfer_info(7, np.empty(0, dtype=np.int32), -1))
    assert isinstance(dummy, SglangTransferInfo) and dummy.is_dummy


@pytest.mark.parametrize("frames, field", [
    ([b"NOPE"], "NixlMsgGuard"),
    ([GUARD, b"1", b"x"], "neither a registration"),
    ([*sglang_transfer_info(1, np.array([1], dtype=np.int32), 0)[:5], b"\x01\x02\x03", b"0", b"1", b""],
     "destination pages"),
    ([*sglang_transfer_info(1, np.array([1], dtype=np.int32), 0)[:6], b"2.5", b"1", b""], "aux index"),
    ([GUARD, b"-3", *sglang_transfer_info(1, np.array([1], dtype=np.int32), 0)[2:]], "room"),
    ([GUARD, b"12", b"127.0.0.1", b"99999", *sglang_transfer_info(1, np.array([1], dtype=np.int32), 0)[4:]],
     "decode port"),
    ([*sglang_register([1], [2])[:6], b"\x00" * 7, *sglang_register([1], [2])[7:]], "kv pointers"),
    ([*sglang_register([1], [2])[:4], b"\xff\xfe", *sglang_register([1], [2])[5:]], "agent name"),
    ([*sglang_register([1], [2])[:5], b"m" * (2**20 + 1), *sglang_register([1], [2])[6:]], "agent metadata"),
])
def test_bad_frames_are_refused_naming_the_field_never_asserted(frames: list[bytes], field: str) -> None:
    with pytest.raises(RemoteProtocolError, match=field):
        decode_frames(frames)


def test_notification_strings() -> None:
    assert kv_notification(4535838703865032264, 1, True, 0) == b"4535838703865032264_kv_1_1_0"
    assert aux_notification(12) == b"12_aux" and state_notification(12, 1) == b"12_state_1"
    note = parse_notification(b"4535838703865032264_kv_1_1_0")
    assert (note.room, note.kind, note.chunk, note.is_last, note.pp_rank) == (4535838703865032264, "kv", 1, True, 0)
    assert parse_notification(b"5_kv_0_0").pp_rank == 0  # 0.5.5 had no pp rank
    for bad in (b"", b"x_kv_0_0_0", b"5_kv_0_2_0", b"5_kv_-1_0_0", b"5_aux_1", b"5_sta", b"\xff_aux", b"5_kv_0_1_0_9"):
        with pytest.raises(RemoteProtocolError):
            parse_notification(bad)


def test_completion_counts_chunks_in_any_order_and_needs_the_aux_row() -> None:
    done = SglangCompletion()
    for raw in (b"9_kv_1_1_0", b"9_kv_0_0_0"):  # observed: the last chunk's notification came first
        done.add(parse_notification(raw))
        assert not done.done
    done.add(parse_notification(b"9_kv_0_0_0"))  # a duplicate changes nothing
    done.add(parse_notification(b"9_aux"))
    assert done.done and done.error is None
    with_state = SglangCompletion(pp_ranks=2, expects_state=True)
    for raw in (b"3_kv_0_1_0", b"3_kv_0_1_1", b"3_aux", b"3_state_0"):
        with_state.add(parse_notification(raw))
    assert not with_state.done
    with_state.add(parse_notification(b"3_state_1"))
    assert with_state.done


@pytest.mark.parametrize("notes, error", [
    ([b"9_kv_0_1_0", b"9_kv_1_0_0"], "after its last chunk"),
    ([b"9_kv_2_1_0", b"9_kv_0_1_0"], "two last chunks"),
    ([b"9_kv_0_1_3"], "pp rank 3 notified"),
])
def test_completion_fails_a_room_sglang_would_leave_waiting(notes: list[bytes], error: str) -> None:
    done = SglangCompletion()
    for raw in [*notes, b"9_aux"]:
        done.add(parse_notification(raw))
    assert not done.done and error in (done.error or "")
