from __future__ import annotations

import pytest

from asynckv.proto.auth import Authenticator, AuthError
from asynckv.proto.messages import decode, encode

from .samples import SAMPLES

NOW = 1_800_000_000_000_000_000
TO = "tcp://127.0.0.1:41000"


def test_seal_then_open_round_trip() -> None:
    a, b = Authenticator("secret"), Authenticator("secret")
    frames = encode(SAMPLES["transfer_info"])
    sealed = a.seal(frames, TO, NOW)
    assert len(sealed) == len(frames) + 1
    assert decode(b.open(sealed, TO, NOW + 10**9)) == SAMPLES["transfer_info"]


@pytest.mark.parametrize("case, kind", [("missing", "missing"), ("other_token", "bad_mac"), ("altered", "bad_mac"),
                                        ("stale", "stale"), ("replayed", "replayed"), ("other_rank", "bad_mac")])
def test_refusals(case: str, kind: str) -> None:
    sender, receiver = Authenticator("secret"), Authenticator("secret")
    frames = encode(SAMPLES["status_ok"])
    sealed = sender.seal(frames, TO, NOW)
    now = NOW
    if case == "missing":
        sealed = frames
    elif case == "other_token":
        sealed = Authenticator("guess").seal(frames, TO, NOW)
    elif case == "altered":
        sealed = [sealed[0], sealed[1].replace(b"42", b"43"), *sealed[2:]]
    elif case == "stale":
        now = NOW + 31 * 10**9
    elif case == "replayed":
        receiver.open(sealed, TO, now)
    to = "tcp://127.0.0.1:41001" if case == "other_rank" else TO  # sealed for one rank, shown to another
    with pytest.raises(AuthError) as info:
        receiver.open(sealed, to, now)
    assert info.value.kind == kind


def test_http_header() -> None:
    a = Authenticator("secret")
    header = a.http_header("PUT", "/route", b"{}", NOW)
    Authenticator("secret").check_http("PUT", "/route", b"{}", header, NOW)
    with pytest.raises(AuthError, match="bad_mac"):
        Authenticator("secret").check_http("DELETE", "/route", b"{}", header, NOW)
    with pytest.raises(AuthError, match="malformed"):
        a.check_http("PUT", "/route", b"{}", "nonsense", NOW)
    with pytest.raises(AuthError, match="missing"):
        a.check_http("PUT", "/route", b"{}", None, NOW)
    for ts in (-1, 2**64):  # (raised struct.error: a 500 from the server)
        with pytest.raises(AuthError, match="malformed"):
            a.check_http("PUT", "/route", b"{}", f"{ts}.{'00' * 16}.{'00' * 32}", NOW)


def test_nonce_memory_is_bounded() -> None:
    a = Authenticator("secret", max_nonces=10)
    for i in range(100):
        a.open(a.seal(encode(SAMPLES["ping"]), TO, NOW + i), TO, NOW + i)
    assert len(a._seen) <= 10


def test_a_replay_is_refused_even_once_its_nonce_was_forgotten_within_the_window() -> None:
    """The table keeps max_nonces; a captured message replayed after that many others (and still
    inside the 30 s window) was accepted again. Now anything as old as what was forgotten is refused."""
    a = Authenticator("secret", max_nonces=100)
    captured = a.seal(encode(SAMPLES["ping"]), TO, NOW)
    a.open(captured, TO, NOW)
    for i in range(1, 150):
        a.open(a.seal(encode(SAMPLES["ping"]), TO, NOW + i), TO, NOW + i)
    with pytest.raises(AuthError, match="replayed"):
        a.open(captured, TO, NOW + 200)
    a.open(a.seal(encode(SAMPLES["ping"]), TO, NOW + 300), TO, NOW + 300)  # fresh messages still pass
