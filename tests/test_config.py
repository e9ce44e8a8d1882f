from __future__ import annotations

import pytest

from asynckv import Config, InvalidArgument


def test_defaults_are_valid() -> None:
    cfg = Config()
    assert cfg.waiting_timeout_s == 300.0 and cfg.nixl_backend == "UCX"


def test_environment_and_legacy_variables() -> None:
    cfg = Config.from_env({"ASYNCKV_WAITING_TIMEOUT_S": "12.5", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "7",
                           "ASYNCKV_PREPPED_DLISTS": "off", "ASYNCKV_MAX_DESCS_PER_XFER": "99"})
    assert (cfg.waiting_timeout_s, cfg.bootstrap_timeout_s, cfg.prepped_dlists, cfg.max_descs_per_xfer) == (
        12.5, 7.0, False, 99)


def test_asynckv_name_wins_over_the_legacy_one() -> None:
    cfg = Config.from_env({"ASYNCKV_WAITING_TIMEOUT_S": "1", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "2"})
    assert cfg.waiting_timeout_s == 1.0


@pytest.mark.parametrize("env, needle", [
    ({"ASYNCKV_WAITING_TIMEOUT_S": "soon"}, "ASYNCKV_WAITING_TIMEOUT_S='soon'"),
    ({"ASYNCKV_PREPPED_DLISTS": "maybe"}, "ASYNCKV_PREPPED_DLISTS"),
    ({"ASYNCKV_WAITING_TIMEOUT_S": "-1"}, "waiting_timeout_s must be > 0"),
    ({"ASYNCKV_MAX_DESCS_PER_XFER": "0"}, "max_descs_per_xfer must be >= 1"),
    ({"ASYNCKV_CONTROL_TRANSPORT": "udp"}, "control_transport must be one of auto, stream, zmq, got 'udp'"),
    ({"ASYNCKV_IDLE_POLL_S": "5"}, "idle_poll_s must be <= 1 s, got 5.0"),
    ({"ASYNCKV_CONTROL_TRANSPORT": "stream", "ASYNCKV_WIRE": "sglang-0.5.10"}, "is carried by ZMQ"),
])
def test_bad_values_are_refused_naming_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle.replace("(", r"\(")):
        Config.from_env(env)


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.host = "0.0.0.0"  # type: ignore[misc]


def test_the_control_transport_is_streams_on_asynckvs_wire_and_zmq_on_sglangs() -> None:
    assert Config().control == "stream" and Config(wire="sglang-0.5.10").control == "zmq"
    assert Config.from_env({"ASYNCKV_CONTROL_TRANSPORT": "zmq"}).control == "zmq"
    assert Config(control_transport="zmq", wire="sglang-0.5.10").control == "zmq"
