"""Prefix routing's placements shared between routers: real ZeroMQ sockets with CURVE on
loopback, a subscriber let in only when it is a registered router."""

import threading
from collections import deque

import pytest

from llmgw import bus
from llmgw_router import share
from llmgw_router.share import Share, decode, encode
from tests.helpers import eventually, free_port


@pytest.fixture
def keys(tmp_path):
    """name -> (keypair, z85 public key), made as `llmgw routers add` makes them."""
    out = {}
    for name in ("a", "b", "c"):
        public = bus.create_keypair(tmp_path, name)
        out[name] = (bus.load_keypair(tmp_path, name, "routers"), public)
    return out


@pytest.fixture
def started():
    shares = []

    def start(*args, **kw):
        s = Share(*args, **kw)
        s.start()
        shares.append(s)
        return s

    yield start
    for s in shares:
        s.stop()


def counted():
    """An on_count that remembers what it was told, and an event per kind."""
    seen: dict[str, int] = {}
    events = {w: threading.Event() for w in ("sent", "heard", "dropped", "malformed")}

    def on_count(what, n):
        seen[what] = seen.get(what, 0) + n
        events[what].set()

    return seen, events, on_count


def registered(keys, *names):
    by_key = {keys[n][1]: n for n in names}
    return lambda public: by_key.get(public)


def publish_until(pub: Share, inbox: deque, *args):
    """Publish until the subscriber has heard something: a PUB socket drops what it
    sends before a subscriber's handshake is done."""

    def heard():
        if not inbox:
            pub.publish(*args)
        return bool(inbox)

    eventually(heard, timeout=15, what="the peer to hear the publisher")


def test_a_registered_router_hears_each_choice_and_end(keys, started):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    a = started("a", endpoint, {}, keys["a"][0], deque(), lookup=registered(keys, "b"))
    heard = deque()
    started("b", "", {"a": (endpoint, keys["a"][1])}, keys["b"][0], heard)
    publish_until(a, heard, "r0", 1, 200.5, (1, 2, 2**64 - 1))
    assert heard.popleft() == ("a", "r0", 1, 200.5, (1, 2, 2**64 - 1))
    heard.clear()
    a.publish("r0", 0, 0.0)  # the request ended
    eventually(lambda: heard, what="the end to be heard")
    assert list(heard)[-1] == ("a", "r0", 0, 0.0, ())


def test_a_router_that_is_not_registered_hears_nothing(keys, started):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    asked = threading.Event()
    allowed = registered(keys, "b")

    def lookup(public):
        if public == keys["c"][1]:
            asked.set()
        return allowed(public)

    a = started("a", endpoint, {}, keys["a"][0], deque(), lookup=lookup)
    outsider = deque()
    started("c", "", {"a": (endpoint, keys["a"][1])}, keys["c"][0], outsider)
    assert asked.wait(15), "the outsider's handshake never reached the authenticator"
    insider = deque()
    started("b", "", {"a": (endpoint, keys["a"][1])}, keys["b"][0], insider)
    publish_until(a, insider, "r0", 1, 1.0, (7,))  # sent after the outsider was refused
    assert not outsider


def test_a_peer_speaks_only_for_itself(keys, started):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # Router a's keys, but it calls itself mallory in its messages.
    a = started("mallory", endpoint, {}, keys["a"][0], deque(), lookup=registered(keys, "b"))
    seen, events, on_count = counted()
    heard = deque()
    started("b", "", {"a": (endpoint, keys["a"][1])}, keys["b"][0], heard, on_count=on_count)

    def refused():
        a.publish("r0", 1, 1.0, (7,))
        return events["malformed"].is_set()

    eventually(refused, timeout=15, what="the spoofed message to be refused")
    assert not heard and "heard" not in seen


def test_a_silent_peer_is_forgotten(keys, started, monkeypatch):
    monkeypatch.setattr(share, "PEER_SILENT_S", 0.5)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    a = started("a", endpoint, {}, keys["a"][0], deque(), lookup=registered(keys, "b"))
    heard = deque()
    started("b", "", {"a": (endpoint, keys["a"][1])}, keys["b"][0], heard)
    publish_until(a, heard, "r0", 2, 50.0, ())
    # a says nothing more (no event loop: no heartbeats): b forgets its work.
    eventually(lambda: ("a", None, 0, 0.0, ()) in heard, what="the silent peer to be forgotten")


def test_a_publish_with_no_subscriber_never_blocks_and_is_counted(keys, started):
    seen, _, on_count = counted()
    a = started("a", f"tcp://127.0.0.1:{free_port()}", {}, keys["a"][0], deque(),
                lookup=registered(keys), on_count=on_count)  # fmt: skip
    for _ in range(100):
        a.publish("r0", 1, 1.0, tuple(range(50)))
    assert seen == {"sent": 100}


def test_messages_round_trip_and_malformed_ones_are_refused():
    msg = encode("router-a", "replica-1", 3, 1234.5, (0, 2**63, 2**64 - 1))
    assert decode(msg) == ("router-a", "replica-1", 3, 1234.5, (0, 2**63, 2**64 - 1))
    assert decode(encode("a", "r", 0, 0.0)) == ("a", "r", 0, 0.0, ())
    assert decode(b"") is None
    assert decode(b"a\0r") is None
    assert decode(msg[:-1]) is None  # a torn block hash
    assert decode(b"\xff\0r\0" + msg.split(b"\0", 2)[2]) is None  # not UTF-8
