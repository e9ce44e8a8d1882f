"""A decode core driven directly with hand-made messages, for the decode staging tests: a TP1 rank of
8 heads (2 layers, K and V, 4-token pages of 8-byte heads) with a real staging area, and the prefill
instance(s) it registers with. Nothing crosses a network; the core takes ``now`` explicitly."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from asynckv.config import Config
from asynckv.layout import KVArgs
from asynckv.proto import actions as act
from asynckv.proto.bootstrap import PrefillRank
from asynckv.proto.decode import DecodeCore
from asynckv.proto.messages import Ping, Register, RegisterResult, Status, TransferInfo
from asynckv.proto.topology import PrefillInstance, stub_agent_metadata
from asynckv.service.decode_staging import DecodeStaging

ADDR = "10.0.0.1:8998"
ADDR_B = "10.0.0.2:8998"
ME = "decode-agent-0001"
PAGE, HEADS, HEAD_BYTES, PAGES, LAYERS = 4, 8, 8, 32, 2
ITEM = PAGE * HEADS * HEAD_BYTES
ENTRIES = 2 * LAYERS


def decode_args(kv: np.ndarray, tp: int = 1, engine_rank: int = 0, nsa: np.ndarray | None = None) -> KVArgs:
    """With ``nsa`` (one row per layer): NSA state pages of 64 bytes, one entry per layer."""
    state: dict[str, Any] = {} if nsa is None else dict(
        state_type="nsa", state_data_ptrs=[int(row.ctypes.data) for row in nsa],
        state_data_lens=[nsa[0].nbytes] * len(nsa), state_item_lens=[64] * len(nsa),
        state_layer_ids=list(range(len(nsa))))
    return KVArgs(kv_data_ptrs=[int(kv[e].ctypes.data) for e in range(len(kv))], kv_data_lens=[kv[0].nbytes] * len(kv),
                  kv_item_lens=[ITEM] * len(kv), aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[],
                  page_size=PAGE, tp_size=tp, engine_rank=engine_rank, kv_head_num=HEADS,
                  total_kv_head_num=HEADS * tp, **state)


def decode_register(args: KVArgs) -> Register:
    """The ``Register`` a decode rank with ``args`` (KV only, no state) sends before it names a prefill rank."""
    return Register(
        decode_id=ME, prefill_id="", session=0, lease_ms=0, endpoint="tcp://10.0.0.9:5000",
        engine_rank=args.engine_rank, tp_size=args.tp_size, page_size=args.page_size, kv_dtype="bfloat16",
        mem_kind="DRAM", is_mla=False, gpu_id=0, kv_ptrs=tuple(args.kv_data_ptrs), kv_lens=tuple(args.kv_data_lens),
        kv_item_lens=tuple(args.kv_item_lens), kv_layer_ids=tuple(range(len(args.kv_data_ptrs))), aux_ptrs=(),
        aux_lens=(), aux_item_lens=(), scratch_ptr=0, scratch_len=0, kv_head_num=args.kv_head_num,
        total_kv_head_num=args.total_kv_head_num, state_type="none", state_ptrs=(), state_lens=(), state_item_lens=(),
        state_layer_ids=(), state_dims=(), state_outer=(), agent_metadata=stub_agent_metadata(ME))


def prank(tp_size: int, tp: int, prefix: str = "prefill", host: str = "10.0.0.1", pp_size: int = 1,
          pp: int = 0) -> PrefillRank:
    """Rank ``tp`` of stage ``pp``: agent ``{prefix}-{tp}`` (``{prefix}-s{pp}-{tp}`` past the first stage)."""
    name = f"{prefix}-{tp}" if pp == 0 else f"{prefix}-s{pp}-{tp}"
    return PrefillRank(tp_size=tp_size, tp_rank=tp, pp_size=pp_size, pp_rank=pp, dp_size=1, dp_rank=0,
                       endpoint=f"tcp://{host}:{17000 + 100 * pp + tp}", agent_id=name, page_size=PAGE,
                       kv_dtype="bfloat16", is_mla=False)


def instance(tp_size: int, prefix: str = "prefill", host: str = "10.0.0.1", pp_size: int = 1) -> PrefillInstance:
    return PrefillInstance(tp_size=tp_size, pp_size=pp_size, dp_size=1, page_size=PAGE, kv_dtype="bfloat16",
                           is_mla=False, protocol_version=prank(tp_size, 0).protocol_version,
                           ranks={(0, t, p): prank(tp_size, t, prefix, host, pp_size, p)
                                  for t in range(tp_size) for p in range(pp_size)})


class Rig:
    """A decode core (TP ``tp``, this rank ``engine_rank``) with a staging area as large as ``slots`` pages of
    a rank of the TP ``tp_prefill`` prefill at ``ADDR`` (slots hold half our heads: past TP2, fewer and larger)."""

    def __init__(self, slots: int = 8, tp_prefill: int = 2, tp: int = 1, engine_rank: int = 0,
                 config: Config | None = None, pp_prefill: int = 1, nsa: bool = False) -> None:
        self.kv = np.zeros((ENTRIES, PAGES * ITEM), dtype=np.uint8)
        self.nsa = np.zeros((LAYERS, PAGES * 64), dtype=np.uint8) if nsa else None
        args = decode_args(self.kv, tp, engine_rank, self.nsa)
        per_slot = ENTRIES * ITEM * max(1, HEADS * tp // tp_prefill) // HEADS
        self._start(args, slots * per_slot, config, tp_prefill, pp_prefill)

    def _start(self, args: KVArgs, staging_bytes: int, config: Config | None, tp_prefill: int,
               pp_prefill: int) -> None:
        """The area, the core and the TP ``tp_prefill`` instance at ``ADDR``, for a rank with ``args``."""
        self.staging = DecodeStaging(staging_bytes, args)
        self.config = config or Config()
        self.core = DecodeCore(ME, "tcp://10.0.0.9:5000", args, self.config, decode_register(args),
                               itertools.count(1), self.staging)
        self.now = 0.0
        self.inst = instance(tp_prefill, pp_size=pp_prefill)
        self.core.topology_fetched(ADDR, self.inst, self.now)
        self.out: list[act.Action] = []
        self.sessions: dict[str, int] = {}
        self.registers: dict[str, Register] = {}

    def agents(self, addr: str = ADDR) -> list[str]:
        inst = self.core.instances[addr]
        return [r.agent_id for r in inst.ranks.values()]

    def take(self) -> list[act.Action]:
        self.out += self.core.actions()
        got, self.out = self.out, []
        for a in got:
            if isinstance(a, act.Send) and isinstance(a.msg, Register):
                self.sessions[a.msg.prefill_id] = a.msg.session
                self.registers[a.msg.prefill_id] = a.msg
        return got

    def room(self, room: int, pages: list[int], addr: str = ADDR, state: list[int] | None = None) -> Any:
        r = self.core.open_receiver(addr, room, self.now)
        self.core.receiver_init(r, pages, -1, state, 0, self.now)
        return r

    def register_all(self) -> list[act.Action]:
        out = self.take()
        for agent, session in list(self.sessions.items()):
            reg = self.core.registrations.get(agent)
            if reg is not None and not reg.registered and reg.session == session:
                self.core.receive(RegisterResult(agent, ME, session, True, ""), self.now)
        return out + self.take()

    def status(self, r: Any, agent: str, ok: bool = True, reason: str = "") -> None:
        rank = r.ranks[agent].rank
        sender_rank = rank.tp_rank * rank.pp_size + rank.pp_rank  # (as a prefill numbers itself, DP 0)
        self.core.receive(Status(r.room, r.epoch, agent, self.sessions[agent], sender_rank, ok, reason), self.now)

    def succeed(self, r: Any, agents: list[str] | None = None) -> list[act.Action]:
        for agent in agents if agents is not None else [a for a, p in r.ranks.items() if not p.dummy]:
            self.status(r, agent)
        return self.take()

    def ping_all(self) -> None:
        """Every registered prefill rank pings (keeps its liveness and the cached topology fresh)."""
        for agent, reg in list(self.core.registrations.items()):
            if reg.registered:
                self.core.receive(Ping(agent, reg.rank.endpoint, reg.session, 1), self.now)

    def tick(self, to: float) -> list[act.Action]:
        self.now = to
        self.core.handle_timer(self.now)
        return self.take()


def infos(actions: list[act.Action]) -> dict[tuple[int, str], TransferInfo]:
    return {(a.msg.room, a.msg.prefill_id): a.msg for a in actions
            if isinstance(a, act.Send) and isinstance(a.msg, TransferInfo)}


def scatters(actions: list[act.Action]) -> list[act.Scatter]:
    return [a for a in actions if isinstance(a, act.Scatter)]


def assert_nothing_leaks(rig: Rig) -> None:
    assert rig.staging.free_slots == rig.staging.slots
    assert not rig.core._slot_waiters
    counts = rig.core.room_counts()
    assert counts["fencing_rooms"] == 0 and counts["topology_lookups"] == 0, counts
