"""The sans-IO layers import no I/O library; the public surface is pinned."""

from __future__ import annotations

import ast
import pathlib
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


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_service_layer_talks_to_transport_protocols_only() -> None:
    """zmq and nixl are imported by ``asynckv.transport`` alone; the service layer pumps cores."""
    root = pathlib.Path(asynckv.__file__).parent
    for path in sorted((root / "service").glob("*.py")):
        leaked = imported_modules(path) & {"zmq", "nixl"}
        assert not leaked, f"{path.name} imports {leaked}"
    for package in ("proto", "kernels"):
        for path in sorted((root / package).glob("*.py")):
            leaked = imported_modules(path) & {"zmq", "nixl", "aiohttp", "asyncio", "uvloop", "time"}
            assert not leaked, f"{package}/{path.name} imports {leaked} (time is a parameter there)"


def test_no_module_is_over_about_400_lines() -> None:
    root = pathlib.Path(asynckv.__file__).parent
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > 430}
    assert not long, long
