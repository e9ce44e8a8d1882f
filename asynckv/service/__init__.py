"""The thin asyncio layer: managers, their pumps, senders, receivers and the bootstrap server."""

from .bootstrap import BootstrapClient, BootstrapServer
from .manager import KVManager, Mode
from .receiver import KVReceiver
from .sender import KVSender

__all__ = ["BootstrapClient", "BootstrapServer", "KVManager", "KVReceiver", "KVSender", "Mode"]
