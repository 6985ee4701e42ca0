"""The agent's fabric test endpoint and client, in-process on loopback."""

import socket
import threading
import time

import pytest

from llmgw.config import AgentConfig
from llmgw_agentd import fabric
from tests.helpers import eventually, free_range


def open_endpoint(token: str, seconds: float = 10.0, address: str = "127.0.0.1"):
    sock = fabric._bind(address, 0, 0)
    t = threading.Thread(target=fabric.serve, args=(sock, token, time.monotonic() + seconds),
                         daemon=True)  # fmt: skip
    t.start()
    return sock.getsockname()[1], t


def test_latency_and_bandwidth_are_measured_against_an_endpoint():
    port, t = open_endpoint("tok")
    result = fabric.measure("127.0.0.1", port, "tok", pings=5, size=3 * fabric.CHUNK + 7)
    assert result["bytes"] == 3 * fabric.CHUNK + 7
    assert result["pings"] == 5
    assert 0 < result["latency_min_ms"] <= result["latency_ms"]
    assert result["bits_per_second"] > 0
    t.join(5)
    assert not t.is_alive()  # one test, then it closes


def test_a_client_without_the_token_gets_nothing():
    port, t = open_endpoint("right")
    with pytest.raises(OSError, match="wrong token"):
        fabric.measure("127.0.0.1", port, "wrong", pings=1, size=10)
    assert t.is_alive()  # still waiting for the client that knows it
    fabric.measure("127.0.0.1", port, "right", pings=1, size=10)


def test_an_endpoint_nobody_uses_closes_when_its_time_is_up():
    port, t = open_endpoint("tok", seconds=0.2)
    t.join(5)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def collect():
    posted = []
    return posted, lambda kind, body: posted.append((kind, body))


@pytest.mark.parametrize("address", ["", "0.0.0.0", "::"])
def test_no_endpoint_is_opened_on_a_wildcard_or_unset_fabric_address(address):
    posted, post = collect()
    tester = fabric.Tester(AgentConfig(fabric_address=address), "a", post)
    tester.handle("fabric_listen", {"request": "r1", "token": "t"})
    eventually(lambda: posted, what="the answer")
    kind, body = posted[0]
    assert kind == fabric.READY and body["request"] == "r1"
    assert "binds only to this node's fabric address" in body["error"]
    assert "port" not in body


def test_the_endpoint_binds_to_the_fabric_address_in_the_configured_ports():
    lo, hi = free_range()
    posted, post = collect()
    cfg = AgentConfig(fabric_address="127.0.0.2", fabric_test_port_min=lo, fabric_test_port_max=hi)
    fabric.Tester(cfg, "b", post).handle("fabric_listen", {"request": "r", "token": "t"})
    eventually(lambda: posted, what="ready")
    _, ready = posted[0]
    assert ready["address"] == "127.0.0.2" and lo <= ready["port"] <= hi
    with pytest.raises(OSError):  # not on every address: 127.0.0.1 has nothing there
        socket.create_connection(("127.0.0.1", ready["port"]), timeout=1).close()
    fabric.Tester(cfg, "a", post).handle("fabric_test", {
        "request": "q", "target": "b", "address": "127.0.0.2", "port": ready["port"],
        "token": "t", "bytes": 1000,
    })  # fmt: skip
    eventually(lambda: len(posted) == 2, what="the result")
    kind, result = posted[1]
    assert kind == fabric.RESULT and result["error"] == "" and result["bytes"] == 1000
    assert (result["request"], result["node"], result["target"]) == ("q", "a", "b")


def test_a_test_to_nowhere_answers_with_an_error_not_silence():
    posted, post = collect()
    port = fabric._bind("127.0.0.1", 0, 0)
    closed = port.getsockname()[1]
    port.close()
    fabric.Tester(AgentConfig(), "a", post).handle(
        "fabric_test", {"request": "q", "address": "127.0.0.1", "port": closed, "token": "t"}
    )
    eventually(lambda: posted, what="the result")
    assert posted[0][1]["error"].startswith(f"127.0.0.1:{closed}: ")
