"""Public test kit for your own pytest-asyncio tests.

- Workloads verifiable byte for byte: ``KVPool``, ``fill_pages``, ``verify_pages``.
- Real faults: ``PeerProcess`` runs a prefill or decode rank in a child process you can
  SIGKILL or SIGSTOP.
- Injected faults: ``FaultInjector`` makes data-plane posts fail, stall or slow down.
"""

from .faults import FaultInjector, inject
from .processes import PeerProcess
from .workload import KVPool, Request, fill_aux, fill_pages, make_plan, verify_aux, verify_pages

__all__ = [
    "FaultInjector",
    "KVPool",
    "PeerProcess",
    "Request",
    "fill_aux",
    "fill_pages",
    "inject",
    "make_plan",
    "verify_aux",
    "verify_pages",
]
