"""asynckv as SGLang's KV transfer backend: ``--disaggregation-transfer-backend asynckv``.

SGLang's schedulers drive a backend through ``BaseKVManager``, ``BaseKVSender``,
``BaseKVReceiver`` and ``BaseKVBootstrapServer`` (``sglang.srt.disaggregation.base.conn``),
calling ``poll()`` on every queued request every iteration and MIN-reducing the results over
the TP group. These classes implement that interface on asynckv's own manager, bootstrap
server, control channel and data plane (none of SGLang's ``Nixl*``/``Common*`` code is used):

- each scheduler process runs one asynckv ``KVManager`` on a background event-loop thread
  (``LoopThread.shared()``); the bootstrap-server class runs asynckv's ``BootstrapServer`` on
  that thread of the tokenizer process;
- ``poll()`` returns a value kept current by callbacks on the loop: it reads one attribute and never
  blocks (moves take a lock for a few instructions); it only moves forward (Bootstrapping,
  WaitingForInput, Transferring, then Success or Failed), so TP ranks converge;
- ``init()``, ``send()``, ``send_metadata()``, ``abort()`` and ``clear()`` hand their work to the
  loop without waiting (in call order); an error there fails the room, with its reason;
- ``failure_exception()`` raises ``SglangTransferError`` carrying asynckv's exception and reason, and
  clears the room (SGLang drops failed requests without ``clear()``);
- a decode rank's own failure or abort reads Failed only once asynckv fenced the room (SGLang gives
  the pages back when it reads Failed); 0.5.23's deferred release waits for that fence too.

``install()`` registers the backend in a running SGLang 0.5.10 or 0.5.23 (enum member, CLI choice,
``get_kv_class`` in ``disaggregation/utils.py`` and in the modules that imported it by name).
SGLang 0.5.23 calls it itself, through asynckv's ``sglang.srt.plugins`` entry point. SGLang 0.5.10
starts its schedulers with ``spawn``: start the server with ``python -m asynckv.integrations.sglang
<sglang launch_server args>``, which installs the backend in every process it spawns
(docs/integration.md).
"""

from __future__ import annotations

import enum
import logging
import sys
from typing import Any

from .backend import (
    CLASSES,
    AsynckvKVBootstrapServer,
    AsynckvKVManager,
    AsynckvKVReceiver,
    AsynckvKVSender,
)
from .settings import SglangTransferError, asynckv_args

__all__ = [
    "BACKEND",
    "SUPPORTED_VERSIONS",
    "AsynckvKVBootstrapServer",
    "AsynckvKVManager",
    "AsynckvKVReceiver",
    "AsynckvKVSender",
    "SglangTransferError",
    "asynckv_args",
    "install",
]

log = logging.getLogger("asynckv.sglang")

BACKEND = "asynckv"
"""The value of ``--disaggregation-transfer-backend`` that selects asynckv."""
SUPPORTED_VERSIONS = ("0.5.10", "0.5.23")
"""SGLang versions whose backend interface these classes implement and the tests exercise."""

# -- registration in SGLang ------------------------------------------------------------------------


_IMPORTERS = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
              "sglang.srt.managers.disagg_service")
"""Modules that bound ``get_kv_class`` by name when they were imported (``from ... import``)."""


def install() -> None:
    """Make ``--disaggregation-transfer-backend asynckv`` select these classes in this process.

    Idempotent. Refuses an SGLang version other than ``SUPPORTED_VERSIONS`` naming both."""
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(f"asynckv's SGLang backend supports SGLang {', '.join(SUPPORTED_VERSIONS)}; this is "
                           f"SGLang {version}")
    from sglang.srt.disaggregation import utils

    try:  # 0.5.23 moved the choice lists here (server_args re-exports the list object)
        from sglang.srt.arg_groups import choices as server_args_module
    except ImportError:
        from sglang.srt import server_args as server_args_module

    backends: type[enum.Enum] = utils.TransferBackend
    member = backends._value2member_map_.get(BACKEND)
    if member is None:
        member = object.__new__(backends)
        member._name_, member._value_ = BACKEND.upper(), BACKEND
        backends._value2member_map_[BACKEND] = member
        backends._member_map_[BACKEND.upper()] = member
        backends._member_names_.append(BACKEND.upper())
    if BACKEND not in server_args_module.DISAGG_TRANSFER_BACKEND_CHOICES:
        server_args_module.DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)  # (the list the CLI's choices are)
    original = getattr(utils.get_kv_class, "__wrapped__", utils.get_kv_class)

    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is member:
            return CLASSES.get(getattr(class_type, "value", class_type))
        return original(transfer_backend, class_type)

    get_kv_class.__wrapped__ = original  # type: ignore[attr-defined]
    utils.get_kv_class = get_kv_class  # modules imported from now on bind this one
    for name in _IMPORTERS:  # those imported already bound the original by name: rebind them
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_kv_class"):
            setattr(module, "get_kv_class", get_kv_class)  # noqa: B010
    log.info("asynckv registered as SGLang %s transfer backend %r", version, BACKEND)
