"""One sample of every control message; their encodings are the golden vectors in tests/data/."""

from __future__ import annotations

import numpy as np

from asynckv.proto.messages import (
    Abort,
    Bye,
    Message,
    Ping,
    Pong,
    Register,
    RegisterResult,
    Status,
    TransferInfo,
)
from asynckv.proto.topology import stub_agent_metadata

SAMPLES: dict[str, Message] = {
    "register": Register(
        decode_id="0b6f3a52-decode", prefill_id="9c1e-prefill", session=3, lease_ms=3250,
        endpoint="tcp://127.0.0.1:41000", engine_rank=1, tp_size=2,
        page_size=16, kv_dtype="bfloat16", mem_kind="DRAM", is_mla=False, gpu_id=0,
        kv_ptrs=(0x7F0000000000, 0x7F0000100000), kv_lens=(1 << 20, 1 << 20), kv_item_lens=(32768, 32768),
        kv_layer_ids=(0, 0), aux_ptrs=(0x7E0000000000,), aux_lens=(4096,), aux_item_lens=(64,),
        scratch_ptr=0x7D0000000000, scratch_len=4096, kv_head_num=4, total_kv_head_num=8, state_type="mamba",
        state_ptrs=(0x7C0000000000,), state_lens=(65536,), state_item_lens=(1024,), state_layer_ids=(3,),
        state_dims=(64,), state_outer=(2,), agent_metadata=stub_agent_metadata("0b6f3a52-decode"),
        state_tp_size=2, state_engine_rank=1, state_head_num=4),
    "register_result_ok": RegisterResult(prefill_id="9c1e-prefill", decode_id="0b6f3a52-decode", session=3,
                                         ok=True, reason=""),
    "register_result_refused": RegisterResult(
        prefill_id="9c1e-prefill", decode_id="0b6f3a52-decode", session=3, ok=False,
        reason="page_size mismatch: prefill has 16, decode has 32"),
    "transfer_info": TransferInfo(room=2**63 - 1, epoch=77, decode_id="0b6f3a52-decode", prefill_id="9c1e-prefill",
                                  aux_index=3, required_dst_info_num=1, is_dummy=False, write_aux=True,
                                  decode_prefix_len=32,
                                  dst_pages=np.array([7, 3, 4, 5, 0], dtype=np.int32),
                                  dst_state_indices=np.array([11], dtype=np.int32)),
    "transfer_info_dummy": TransferInfo(room=0, epoch=1, decode_id="d", prefill_id="p", aux_index=-1,
                                        required_dst_info_num=2, is_dummy=True, write_aux=False, decode_prefix_len=0,
                                        dst_pages=np.array([], dtype=np.int32),
                                        dst_state_indices=np.array([], dtype=np.int32)),
    "status_ok": Status(room=42, epoch=77, prefill_id="9c1e-prefill", session=3, sender_rank=3, ok=True, reason=""),
    "status_failed": Status(room=42, epoch=78, prefill_id="9c1e-prefill", session=3, sender_rank=0, ok=False,
                            reason="peer disconnected (nixlRemoteDisconnectError)"),
    "ping": Ping(sender_id="0b6f3a52-decode", endpoint="tcp://127.0.0.1:41000", session=3, seq=17),
    "pong": Pong(sender_id="9c1e-prefill", session=3, seq=17),
    "bye": Bye(sender_id="9c1e-prefill", session=3, reason="manager closed"),
    "abort": Abort(room=12345678901234, epoch=78, decode_id="0b6f3a52-decode", destination_sent=True,
                   required=2, reason="aborted by decode"),
}
