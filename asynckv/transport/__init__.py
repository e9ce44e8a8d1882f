"""The only modules that import nixl or zmq: the NIXL engine and the ZMQ control channel."""

from .control import ControlChannel, RateLimitedLog
from .engine import NixlEngine, map_nixl_error

__all__ = ["ControlChannel", "NixlEngine", "RateLimitedLog", "map_nixl_error"]
