"""Making a NIXL agent (imported lazily: only a process that starts a data plane loads NIXL)."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

__all__ = ["keep_until_exit", "nixl_agent"]

_ENV_LOCK = threading.Lock()
_KEPT_UNTIL_EXIT: list[Any] = []
"""Agents closed with transfers still in flight: never destroyed (see ``nixl_engine``)."""


def nixl_agent(name: str, backend: str, loopback_only: bool = False) -> Any:
    """A NIXL agent with its backend. ``loopback_only``: UCX listens on the loopback interface only
    (by default UCX's TCP transport listens on every interface the host has, whatever address
    asynckv's control socket binds to). UCX reads ``UCX_NET_DEVICES`` when the agent's UCX context
    is made, so it is set for that moment alone; a value the user set is left as it is."""
    from nixl._api import nixl_agent as make
    from nixl._api import nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[backend])
    if not loopback_only or backend != "UCX" or "UCX_NET_DEVICES" in os.environ:
        return make(name, cfg)
    with _ENV_LOCK:
        os.environ["UCX_NET_DEVICES"] = "lo"
        try:
            return make(name, cfg)
        finally:
            del os.environ["UCX_NET_DEVICES"]


def keep_until_exit(*objs: Any) -> None:
    """Hold ``objs`` past interpreter shutdown: their destructors never run (the OS reclaims them at exit)."""
    if not _KEPT_UNTIL_EXIT:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT_UNTIL_EXIT))  # survives module teardown too
    _KEPT_UNTIL_EXIT.append(objs)
