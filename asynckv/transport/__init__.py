"""The only modules that import nixl or zmq: the NIXL data plane and the control channels (TCP
streams, the default, and ZMQ), behind the protocols of ``transport.base``."""

from .base import ControlPlane, DataPlane, DescPiece, MemoryLayout, PreppedPiece, Write
from .control import ControlChannel
from .nixl import NixlDataPlane, map_nixl_error
from .stream import StreamChannel

__all__ = ["ControlChannel", "ControlPlane", "DataPlane", "DescPiece", "MemoryLayout", "NixlDataPlane",
           "PreppedPiece", "StreamChannel", "Write", "map_nixl_error"]
