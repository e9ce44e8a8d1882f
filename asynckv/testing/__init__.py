"""Public test kit for your own pytest-asyncio tests.

- Workloads verifiable byte for byte: ``KVPool``, ``fill_pages``, ``verify_pages``.
- Real faults: ``PeerProcess`` runs a prefill or decode rank in a child process you can
  SIGKILL or SIGSTOP.
- Injected faults: ``FaultInjector`` wraps a manager's data plane and makes writes fail,
  stall or wait.
- Deterministic: ``ManualClock``; the seeded simulator of many ranks over a simulated
  network and data plane (``asynckv.testing.simulator``, schedules in
  ``asynckv.testing.schedule``: ``python -m asynckv.testing.schedule --seeds 2000``).
"""

from .clock import ManualClock
from .faults import FaultInjector, inject
from .processes import PeerProcess
from .workload import KVPool, Request, fill_aux, fill_pages, make_plan, verify_aux, verify_pages

__all__ = [
    "FaultInjector",
    "KVPool",
    "ManualClock",
    "PeerProcess",
    "Request",
    "fill_aux",
    "fill_pages",
    "inject",
    "make_plan",
    "verify_aux",
    "verify_pages",
]
