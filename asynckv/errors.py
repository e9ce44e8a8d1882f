"""The one exception tree of asynckv.

Families are grouped by what the caller will do about them:

    AsyncKVError
    ├── AsyncKVTimeout (also a builtin TimeoutError)
    │   ├── BootstrapTimeout      decode's destination never reached prefill in time
    │   ├── WaitingTimeout        decode waited too long for the transfer to finish
    │   └── TransferTimeout       an in-flight NIXL transfer passed its deadline
    ├── PeerError
    │   ├── PeerUnreachable       the peer (or its bootstrap server) cannot be reached
    │   └── PeerRestarted         the peer came back with a new incarnation
    ├── TransportError        the data plane (NIXL) refused or failed an operation
    ├── ProtocolError
    │   ├── LocalProtocolError    we were asked to do something the protocol forbids
    │   └── RemoteProtocolError   the peer sent something malformed or refused us
    ├── LayoutMismatch (also a ValueError)   buffers/geometry of the two sides disagree
    ├── InvalidArgument (also a ValueError)  bad input from the caller (indices, sizes)
    ├── TransferFailed        the peer reported the failure of a room, with its reason
    ├── Aborted               the room was aborted by one of the two sides
    └── ClosedError           the manager was closed
"""

from __future__ import annotations

__all__ = [
    "Aborted",
    "AsyncKVError",
    "AsyncKVTimeout",
    "BootstrapTimeout",
    "ClosedError",
    "InvalidArgument",
    "LayoutMismatch",
    "LocalProtocolError",
    "PeerError",
    "PeerRestarted",
    "PeerUnreachable",
    "ProtocolError",
    "RemoteProtocolError",
    "TransferFailed",
    "TransferTimeout",
    "TransportError",
    "WaitingTimeout",
]


class AsyncKVError(Exception):
    """Root of every error asynckv raises or reports."""


class AsyncKVTimeout(AsyncKVError, TimeoutError):
    """Something did not happen before its deadline."""


class BootstrapTimeout(AsyncKVTimeout):
    """Prefill waited too long for decode's destination (or decode for prefill's topology)."""


class WaitingTimeout(AsyncKVTimeout):
    """Decode waited too long for a room's transfer to complete."""


class TransferTimeout(AsyncKVTimeout):
    """An in-flight NIXL transfer passed its deadline and was cancelled."""


class PeerError(AsyncKVError):
    """A peer process or its bootstrap server is not usable."""


class PeerUnreachable(PeerError):
    """The peer cannot be reached (connection refused, disconnected, dead)."""


class PeerRestarted(PeerError):
    """The peer restarted: same address, new incarnation."""


class TransportError(AsyncKVError):
    """The data plane (NIXL) refused or failed an operation."""


class ProtocolError(AsyncKVError):
    """The control protocol was violated."""


class LocalProtocolError(ProtocolError):
    """This side was asked to do something the protocol does not allow (e.g. send twice)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent a malformed message or refused ours."""


class LayoutMismatch(AsyncKVError, ValueError):
    """The two sides' buffers, geometry or capabilities are incompatible."""


class InvalidArgument(AsyncKVError, ValueError):
    """The caller passed invalid input (indices out of range, duplicates, wrong sizes)."""


class TransferFailed(AsyncKVError):
    """The other side reported that the room failed; the message carries its reason."""


class Aborted(AsyncKVError):
    """The room was aborted."""


class ClosedError(AsyncKVError):
    """The manager (or the room) is closed."""
