"""Control endpoints name their transport by scheme; anything else is refused where it is parsed."""

from __future__ import annotations

import pytest

from asynckv.proto.endpoints import endpoint_address, endpoint_host, is_endpoint, transport_of


@pytest.mark.parametrize(("endpoint", "transport", "address"), [
    ("tcp://127.0.0.1:5000", "zmq", ("127.0.0.1", 5000)),
    ("stream://10.0.0.2:65535", "stream", ("10.0.0.2", 65535)),
    ("stream://[::1]:7", "stream", ("::1", 7)),
])
def test_an_endpoint_names_its_transport_and_address(endpoint: str, transport: str, address: tuple[str, int]) -> None:
    assert is_endpoint(endpoint) and transport_of(endpoint) == transport
    assert endpoint_address(endpoint) == address and endpoint_host(endpoint) == address[0]


@pytest.mark.parametrize("endpoint", [
    "udp://127.0.0.1:5000", "stream://127.0.0.1", "stream://:5000", "stream://127.0.0.1:0",
    "stream://127.0.0.1:65536", "stream://127.0.0.1:99999", "stream://127.0.0.1:-1", "tcp://h:5x", 5000, None,
])
def test_anything_else_is_not_an_endpoint(endpoint: object) -> None:
    assert not is_endpoint(endpoint)
    if isinstance(endpoint, str):
        with pytest.raises(ValueError, match="not a control endpoint"):
            endpoint_address(endpoint)
