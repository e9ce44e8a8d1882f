"""Public test kit: deterministic KV workloads that can be verified byte for byte.

Use it in your own pytest-asyncio tests: fill prefill pages with ``fill_pages``, move
them with asynckv, and check the decode side with ``verify_pages``.
"""

from .workload import KVPool, Request, fill_aux, fill_pages, make_plan, verify_aux, verify_pages

__all__ = ["KVPool", "Request", "fill_aux", "fill_pages", "make_plan", "verify_aux", "verify_pages"]
