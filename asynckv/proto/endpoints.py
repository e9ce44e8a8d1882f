"""Control endpoints: ``tcp://host:port`` (ZMQ) and ``stream://host:port`` (a plain TCP stream).

The scheme names the control transport a rank listens with (``Config.control_transport``), so a
rank that reaches a peer on the other one says so instead of sending into the void.
"""

from __future__ import annotations

__all__ = ["SCHEMES", "endpoint_address", "endpoint_host", "is_endpoint", "transport_of"]

SCHEMES = {"tcp://": "zmq", "stream://": "stream"}
"""Endpoint prefix -> the control transport it names."""


def transport_of(endpoint: str) -> str | None:
    """``"zmq"`` or ``"stream"`` for an endpoint of either scheme; None for anything else."""
    for prefix, transport in SCHEMES.items():
        if endpoint.startswith(prefix):
            return transport
    return None


def is_endpoint(endpoint: object) -> bool:
    """A string of a known scheme with a host and a port (1-65535)."""
    if not isinstance(endpoint, str) or transport_of(endpoint) is None:
        return False
    host, _, port = endpoint.partition("://")[2].rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def endpoint_address(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of an endpoint, an IPv6 host without its brackets; ValueError if malformed."""
    if not is_endpoint(endpoint):
        raise ValueError(f"not a control endpoint: {endpoint!r}")
    host, _, port = endpoint.partition("://")[2].rpartition(":")
    return host.strip("[]"), int(port)


def endpoint_host(endpoint: str) -> str:
    """The host of an endpoint, an IPv6 host without its brackets ("" if malformed)."""
    return endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
