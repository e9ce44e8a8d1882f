"""The only modules that import nixl or zmq: the NIXL data plane and the ZMQ control channel,
behind the protocols of ``transport.base``."""

from .base import ControlPlane, DataPlane, DescPiece, MemoryLayout, PreppedPiece, Write
from .control import ControlChannel
from .nixl import NixlDataPlane, map_nixl_error

__all__ = ["ControlChannel", "ControlPlane", "DataPlane", "DescPiece", "MemoryLayout", "NixlDataPlane",
           "PreppedPiece", "Write", "map_nixl_error"]
