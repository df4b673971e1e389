"""Where the gateway's KV-events sockets go, what it refuses to bind, and what a batch may hold."""

from __future__ import annotations

import sys

import pytest

from taogate.control.kv_endpoints import replay_endpoint, require_precise, subscriber_endpoint
from taogate.control.kv_wire import decode
from taogate.instance_settings import InstanceSettings
from taogate.settings import ConfigError, Settings


def test_a_wildcard_is_reached_on_the_instance_host() -> None:
    url = "http://10.0.0.7:8000"
    assert subscriber_endpoint("tcp://*:5557", url) == (True, "tcp://10.0.0.7:5557")  # vLLM's default
    assert subscriber_endpoint("tcp://[::]:5557", "http://[fd00::7]:8000") == (True, "tcp://[fd00::7]:5557")
    assert subscriber_endpoint("tcp://[::1]:5557", url) == (True, "tcp://[::1]:5557")
    assert subscriber_endpoint("ipc:///tmp/kv", url) == (True, "ipc:///tmp/kv")
    assert subscriber_endpoint("tcp://10.0.0.1:5557", url) == (False, "tcp://10.0.0.1:5557")  # we bind
    # vLLM always binds its replay socket: a wildcard there is reached on the instance too
    assert replay_endpoint("tcp://*:5558", url) == "tcp://10.0.0.7:5558"
    assert replay_endpoint("tcp://0.0.0.0:5558", url) == "tcp://10.0.0.7:5558"
    assert replay_endpoint("tcp://10.0.0.7:5558", url) == "tcp://10.0.0.7:5558"


def test_binding_every_interface_is_refused() -> None:
    with pytest.raises(ValueError, match="every interface"):
        InstanceSettings(url="http://h:8000", kv_events="tcp://0.0.0.0:5557")
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        InstanceSettings(url="http://h:8000", kv_events="127.0.0.1:5557")
    InstanceSettings(url="http://h:8000", kv_events="tcp://*:5557", kv_events_replay="tcp://0.0.0.0:5558")


def test_missing_packages_are_said_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(instances=[InstanceSettings(url="http://h:8000", kv_events="tcp://*:5557")])
    monkeypatch.setitem(sys.modules, "msgpack", None)  # not installed
    with pytest.raises(ConfigError, match=r"`msgpack`.*taogate\[precise\]"):
        require_precise(settings)
    require_precise(Settings(instances=[InstanceSettings(url="http://h:8000")]))


def test_a_batch_is_bounded_and_checked() -> None:
    msgpack = pytest.importorskip("msgpack")
    assert decode(msgpack.packb([1.5, [{"type": "AllBlocksCleared"}], 0])) == (
        1.5,
        [{"type": "AllBlocksCleared"}],
    )
    with pytest.raises(ValueError):
        decode(msgpack.packb([1.5, [0] * (3 << 20), 0]))  # more entries than any engine step holds
    with pytest.raises(ValueError):
        decode(msgpack.packb({"ts": 1.5}))
