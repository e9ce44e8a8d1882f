"""The sans-IO layers import no I/O library; the public surface is pinned."""

from __future__ import annotations

import subprocess
import sys

import asynckv

IO_MODULES = ("asyncio", "zmq", "aiohttp", "nixl", "uvloop")


def test_proto_and_kernels_import_no_io_library() -> None:
    code = ("import sys; import asynckv.proto, asynckv.kernels, asynckv.kernels._reference; "
            f"print(sorted(m for m in {IO_MODULES!r} if m in sys.modules))")
    # Import the subpackages without running asynckv/__init__ (which loads the service layer).
    loader = ("import importlib.util, sys, types, pathlib; "
              "root = pathlib.Path(importlib.util.find_spec('asynckv').origin).parent; "
              "pkg = types.ModuleType('asynckv'); pkg.__path__ = [str(root)]; sys.modules['asynckv'] = pkg; ")
    out = subprocess.run([sys.executable, "-c", loader + code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_public_api_names() -> None:
    for name in ("KVArgs", "KVManager", "KVPoll", "Mode", "BootstrapServer", "KVSender", "KVReceiver", "Config",
                 "AsyncKVError", "BootstrapTimeout", "TransferTimeout", "PeerUnreachable", "PeerRestarted",
                 "ProtocolError", "LayoutMismatch", "ClosedError"):
        assert name in asynckv.__all__ and hasattr(asynckv, name)
    assert issubclass(asynckv.BootstrapTimeout, TimeoutError)
    assert issubclass(asynckv.LayoutMismatch, asynckv.AsyncKVError)
