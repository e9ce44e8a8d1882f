"""Frozen, validated configuration.

Every field can be set from the environment as ``ASYNCKV_<FIELD_NAME_UPPER>``; a few
also honour the reference connector's variable (see ``_LEGACY_ENV``). A bad value is
refused at start-up with a message naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .errors import InvalidArgument

__all__ = ["CONTROL_TRANSPORTS", "WIRES", "Config"]

WIRES = ("asynckv", "sglang-0.5.10")
"""The wire protocols a manager can speak."""
CONTROL_TRANSPORTS = ("auto", "stream", "zmq")
"""What can carry control messages (``Config.control_transport``)."""

# Reference-connector variables honoured where they map one to one (the ASYNCKV_ name wins).
_LEGACY_ENV: dict[str, str] = {
    "bootstrap_timeout_s": "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    "waiting_timeout_s": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
    "nixl_backend": "SGLANG_DISAGGREGATION_NIXL_BACKEND",
    "heartbeat_interval_s": "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
    "heartbeat_max_failures": "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Knobs of one KVManager. Defaults are safe for production and for tests here."""

    host: str = "127.0.0.1"
    """Address the control socket binds to and advertises to peers."""
    bootstrap_timeout_s: float = 300.0
    """Prefill: longest wait for decode's destination of a room (KVPoll.Bootstrapping)."""
    waiting_timeout_s: float = 300.0
    """Decode: longest wait from ``receiver.init()`` until the room concludes."""
    http_timeout_s: float = 5.0
    """Timeout of one bootstrap-server HTTP request."""
    register_attempts: int = 5
    """Prefill: attempts to register with the bootstrap server (exponential backoff)."""
    handshake_timeout_s: float = 30.0
    """Decode: longest wait for a prefill instance to be fully registered and to accept us."""
    send_timeout_s: float = 5.0
    """Longest wait to hand one control message to its transport (a full queue, a connection that
    cannot be opened)."""
    host_bootstrap: bool = True
    """Prefill: start an embedded bootstrap server when none answers at bootstrap_addr."""
    nixl_backend: str = "UCX"
    """NIXL backend plugin."""
    idle_poll_s: float = 0.001
    """Longest sleep of a NIXL engine thread between progress rounds while peers may write to it (a
    decode with rooms waiting); with no transfer in flight and none expected it sleeps until its next
    command, 10 ms at most. At most 1 s: it also bounds how late an engine notices that its event loop
    closed with the manager still open (``docs/failures.md``)."""
    write_lanes: int = 2
    """Prefill: NIXL engines (each its own agent on its own thread) that writes are spread over. On
    one host the posting thread does the copy, so one lane copies on one core; two lanes moved
    scattered pages 1.6x and contiguous ones 1.7x as fast on a 2-core VM (benchmarks/bench_scaling.py).
    Each lane registers the rank's memory and prepares each decode peer's dlist once more."""
    staging_bytes: int = 256 * 2**20
    """Prefill: a DRAM area where head slices for a decode at a larger TP are gathered into whole
    pages, so they go out as one descriptor per page instead of one per token (0: off). Allocated
    with the rank (address space; pages become resident as they are used) and registered with
    NIXL; a write finding no room in it is sent per token."""
    decode_staging_bytes: int = 0
    """Decode: a DRAM area that prefill ranks holding fewer heads than this rank (a larger prefill
    TP) write whole pages into, one descriptor per page instead of one per token; decode then copies
    their rows into its pages (0: off, those ranks write per token). Registered with NIXL; a room
    waits for free slots, and one needing more than the area holds fails naming this setting."""
    build_threads: int = 2
    """Prefill: worker threads of the rank's own that build large writes' descriptors and gather head
    slices into the staging area (never the loop's default executor, which the application shares).
    Gathers are memory-bound: on a 2-core VM, TP1 -> TP2 moved 2.0 GB/s with 2, 1.8 with 1 and 1.4
    on the default executor's 6 threads, whose runs fell to 0.85 GB/s (benchmarks/bench_hetero_tp.py)."""
    max_descs_per_xfer: int = 16384
    """Larger writes are split into several NIXL handles, posted one after another."""
    xfer_handle_bytes: int = 64 * 2**20
    """No NIXL handle writes more than this: the write lease is checked before each handle, and a
    handle that started just inside its lease must land within the fence margin (half a heartbeat
    interval, 250 ms): 64 MiB takes ~13 ms at 5 GB/s; below 256 MB/s per write, lower it."""
    offload_min_descs: int = 65536
    """Descriptor math producing at least this many descriptors (as built: x page_size for head
    slices), and destination checks of at least this many indices, run on a worker thread."""
    xfer_deadline_base_s: float = 30.0
    """Every NIXL post must finish within this many seconds plus its bytes at the rate below."""
    xfer_deadline_min_bytes_per_s: float = 50e6
    """Slowest transfer rate tolerated before a post is cancelled as stalled."""
    prepped_dlists: bool = True
    """Post KV with prepared per-peer dlists (NIXL merges runs); else coalesced descriptors."""
    max_rooms: int = 1_000_000
    """Upper bound on per-room table entries per manager (refused beyond)."""
    max_early_infos: int = 65536
    """Prefill: destinations that arrived before their sender was created, kept at most."""
    early_info_ttl_s: float = 600.0
    """Prefill: how long an early destination is kept before it is dropped."""
    heartbeat_interval_s: float = 0.5
    """Both sides ping every peer they work with this often."""
    heartbeat_max_failures: int = 7
    """A peer unheard for interval x this many is declared dead; its rooms fail (default 3.5 s,
    so rooms of a dead peer fail within about 4 s; a busy loop may lag up to ~3 s safely)."""
    fence_timeout_s: float = 5.0
    """Decode: longest wait for prefill to confirm it writes no more into a failed room's pages;
    after it, the silent prefill is declared dead."""
    max_peers: int = 4096
    """Registered peers kept at most per manager; registrations beyond are refused."""
    max_inflight_bytes: int = 8 * 2**30
    """Prefill: bytes posted but not yet landed, at most (a larger single chunk waits to go alone)."""
    max_early_bytes: int = 256 * 2**20
    """Prefill: bytes of destinations kept while they wait (for their sender in the early table, or
    behind an off-loop check), all rooms and peers together; a destination beyond it is refused at
    once with ``Status(ok=False)``. 256 MiB holds a 1,024-page destination (4 KiB) for every one of
    the ``max_early_infos`` rooms, or ~500 of a 128k-token context at page_size 1, while a peer can
    no longer park gigabytes (one destination may be 64 MiB: 16M pages)."""
    max_peer_dlist_rows: int = 2**20
    """Prefill: destination dlist rows (this rank's KV entries x the decode's pages) any decode peer may
    register; a larger pool is accepted only if it is within ``POOL_RATIO`` (4) times this rank's own
    rows, times the decode's TP size over ours (its pages are that much smaller). Checked before any
    row is built: the rows, 24 bytes each, are built from the claim alone. Real pools meet the relative
    bound (a decode rank of the same model holds at most a few times a prefill rank's KV memory); this
    floor of 2**20 rows (24 MiB) serves small prefill pools (tests, demos) and lets an operator admit
    a more asymmetric pair."""
    max_connecting_peers: int = 2
    """Prefill: registrations that build their destination dlist and connect at once; the others wait
    their turn in order (building rows is numpy on a worker thread and NIXL's prep runs on its one
    engine thread, so more at once gain little and multiply peak memory)."""
    ops_port: int = -1
    """Serve /health, /metrics and /peers for this manager on this port (0: any free port,
    -1: off). A manager hosting the bootstrap server serves them there anyway."""
    auth_token: str = ""
    """Shared secret; when set, every control message and mutating bootstrap request is
    authenticated (HMAC-SHA256 with a freshness window). Also ASYNCKV_AUTH_TOKEN."""
    wire: str = "asynckv"
    """The protocol this manager speaks: ``"asynckv"`` (its own, between asynckv ranks) or
    ``"sglang-0.5.10"`` (SGLang 0.5.10's NIXL connector wire, to pair with stock SGLang ranks:
    see docs/interop.md). Also ASYNCKV_WIRE."""
    control_transport: str = "auto"
    """What carries control messages: ``"stream"`` (plain TCP streams read by the event loop) or
    ``"zmq"`` (PUSH/PULL sockets, what asynckv used before and SGLang's wire uses); ``"auto"``:
    stream on asynckv's wire, ZMQ on SGLang's. Two processes exchanging one message at a time, a
    round trip took 87 us and 55 us of CPU in each process on streams against 185 us and 129 us on
    ZMQ (benchmarks/bench_control.py; docs/design-decisions.md, 18). Both sides of a pair must use
    the same one (a mismatch fails the room at once, naming both): set ``"zmq"`` to pair with
    asynckv ranks of earlier versions. Also ASYNCKV_CONTROL_TRANSPORT."""
    sglang_kv_cache_dtype: str = "auto"
    """On the SGLang wire: this rank's ``kv_cache_dtype`` as SGLang names and compares it (its
    ``--kv-cache-dtype``; ``"auto"`` is the model's dtype)."""
    allow_unauthenticated: bool = False
    """Without a token, control traffic (control messages, bootstrap ``/route`` and ``/peers``) is
    accepted from loopback only ("protected mode"); True accepts it from any host, unauthenticated
    (logged as a warning). Also ASYNCKV_ALLOW_UNAUTHENTICATED=1."""

    @property
    def control(self) -> str:
        """The control transport in use: ``control_transport`` with ``"auto"`` resolved."""
        if self.control_transport != "auto":
            return self.control_transport
        return "stream" if self.wire == "asynckv" else "zmq"

    @property
    def close_bound_s(self) -> float:
        """Longest a close waits for writes to settle: a fence's timeout, then a silent peer declared dead, plus 1 s."""
        return self.fence_timeout_s + self.heartbeat_interval_s * self.heartbeat_max_failures + 1.0

    @property
    def protected(self) -> bool:
        """Protected mode: no token and no opt-out, so only loopback peers are heard."""
        return not self.auth_token and not self.allow_unauthenticated

    def __repr__(self) -> str:  # never print the secret
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.auth_token:
            shown["auth_token"] = "***"
        fields = ", ".join(f"{name}={value!r}" for name, value in shown.items())
        return f"Config({fields})"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not value > 0:
                raise InvalidArgument(f"config {f.name} must be > 0, got {value!r}")
        if self.idle_poll_s > 1.0:
            raise InvalidArgument(f"config idle_poll_s must be <= 1 s, got {self.idle_poll_s!r}")
        for name in ("register_attempts", "max_descs_per_xfer", "xfer_handle_bytes", "offload_min_descs",
                     "max_rooms", "max_early_infos", "heartbeat_max_failures", "max_peers", "max_inflight_bytes",
                     "max_early_bytes", "max_peer_dlist_rows", "max_connecting_peers", "write_lanes", "build_threads"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"config {name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("staging_bytes", "decode_staging_bytes"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"config {name} must be >= 0, got {getattr(self, name)!r}")
        if not self.host:
            raise InvalidArgument("config host must not be empty")
        if self.wire not in WIRES:
            raise InvalidArgument(f"config wire must be one of {', '.join(WIRES)}, got {self.wire!r}")
        if self.control_transport not in CONTROL_TRANSPORTS:
            raise InvalidArgument(f"config control_transport must be one of {', '.join(CONTROL_TRANSPORTS)}, "
                                  f"got {self.control_transport!r}")
        if self.wire != "asynckv" and self.control_transport == "stream":
            raise InvalidArgument(f"config wire {self.wire!r} is carried by ZMQ: control_transport must be 'zmq' "
                                  f"or 'auto'")
        if self.wire != "asynckv" and self.auth_token:
            raise InvalidArgument(f"config wire {self.wire!r} cannot carry auth_token: stock SGLang ranks do not "
                                  f"authenticate (keep them on loopback, or isolate their network and set "
                                  f"allow_unauthenticated)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build a config from ``ASYNCKV_*`` variables (and mapped legacy ones), then overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for var in (f"ASYNCKV_{f.name.upper()}", _LEGACY_ENV.get(f.name)):
                if var is None or var not in env:
                    continue
                values[f.name] = _parse(var, env[var], f.type)
                break
        values.update(overrides)
        try:
            return cls(**values)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{exc} (from environment or overrides)") from None


def _parse(var: str, raw: str, type_name: Any) -> Any:
    text = raw.strip()
    try:
        if type_name in ("bool", bool):
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if type_name in ("int", int):
            return int(text)
        if type_name in ("float", float):
            return float(text)
        return text
    except ValueError:
        raise InvalidArgument(f"environment variable {var}={raw!r} is not a valid {type_name}") from None
