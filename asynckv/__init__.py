"""asynckv: asyncio-native KV-cache transfer for prefill/decode disaggregated serving over NIXL."""

from .config import Config
from .errors import (
    Aborted,
    AsyncKVError,
    AsyncKVTimeout,
    BootstrapTimeout,
    ClosedError,
    InvalidArgument,
    LayoutMismatch,
    LocalProtocolError,
    PeerError,
    PeerRestarted,
    PeerUnreachable,
    ProtocolError,
    RemoteProtocolError,
    TransferFailed,
    TransferTimeout,
    TransportError,
    WaitingTimeout,
)
from .layout import KVArgs
from .proto.states import KVPoll
from .service import BootstrapServer, KVManager, KVReceiver, KVSender, Mode

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "AsyncKVError",
    "AsyncKVTimeout",
    "BootstrapServer",
    "BootstrapTimeout",
    "ClosedError",
    "Config",
    "InvalidArgument",
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "LayoutMismatch",
    "LocalProtocolError",
    "Mode",
    "PeerError",
    "PeerRestarted",
    "PeerUnreachable",
    "ProtocolError",
    "RemoteProtocolError",
    "TransferFailed",
    "TransferTimeout",
    "TransportError",
    "WaitingTimeout",
    "__version__",
]
