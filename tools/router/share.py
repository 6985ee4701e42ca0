"""Prefix routing's placements, shared between routers (`router.prefix_share`,
`router.prefix_peers`).

Behind a load balancer that alternates, each router sees about half of a
conversation's turns. Alone it cannot know where another router sent the last one, so
it moved conversations off the replica that held them, and knew other routers' work
only from the engines' probes, up to a second old (bench/ROUTING-RUNS.md, runs 8-30).
So each router publishes every choice it makes (the replica, the prompt's block
hashes, and its own requests and work in flight there) and every end (its requests and
work there now), and subscribes to its peers': what it hears goes into its prefix
index as if it had sent it itself, and their work in flight replaces the probe's word.

The PUB socket is a CURVE server with the router's bus keypair that lets in routers
registered in the store (`llmgw routers add`); each peer is subscribed to with its
registered public key. Nothing on the request path waits: a publish that cannot go out
at once is dropped and counted. A peer silent for PEER_SILENT_S (it beats every
HEARTBEAT_S) is forgotten: its work no longer counts, and choices fall back to the
engines' probes for it.
"""

import array
import struct
import threading
import time
from collections import deque

import zmq

from llmgw import bus, log

_log = log.get("llmgw.router.share")

HEARTBEAT_S = 2.0
PEER_SILENT_S = 3 * HEARTBEAT_S
_LOAD = struct.Struct("<Id")  # requests, tokens of work


def encode(peer: str, replica: str, requests: int, work: float, blocks=()) -> bytes:
    head = b"\0".join((peer.encode(), replica.encode(), b""))
    return head + _LOAD.pack(requests, work) + array.array("Q", blocks).tobytes()


def decode(msg: bytes):
    """(peer, replica, requests, work, blocks), or None for a malformed message."""
    parts = msg.split(b"\0", 2)
    if len(parts) != 3 or len(parts[2]) < _LOAD.size or (len(parts[2]) - _LOAD.size) % 8:
        return None
    requests, work = _LOAD.unpack_from(parts[2])
    blocks = array.array("Q")
    blocks.frombytes(parts[2][_LOAD.size :])
    try:
        peer, replica = parts[0].decode(), parts[1].decode()
    except UnicodeDecodeError:
        return None
    return peer, replica, requests, work, tuple(blocks)


class Share:
    """This router's PUB socket (used on the event loop only) and its subscriptions to
    the peers' (on a thread of its own, which hands what it hears to `inbox`)."""

    def __init__(self, name: str, listen: str, peers: dict[str, tuple[str, str]], keys,
                 inbox: deque, lookup=None, loads=None, on_count=None):  # fmt: skip
        """`peers`: {name: (endpoint, z85 public key)}; `keys`: this router's CURVE
        keypair; `lookup(z85) -> name | None`: a subscriber's registered router name;
        `loads() -> {replica: (requests, work)}`: this router's own, for heartbeats;
        `on_count(what, n)`: sent, heard, dropped."""
        self.name, self.listen, self.peers, self.keys = name, listen, dict(peers), keys
        self.inbox = inbox
        self.lookup = lookup
        self.loads = loads or dict
        self.on_count = on_count or (lambda what, n: None)
        self.ctx = zmq.Context()
        self.auth = None
        self._pub = None
        self._thread = None
        self._stop = threading.Event()
        self._loop = None
        self._beat = None

    def start(self, loop=None) -> None:
        """Bind, subscribe, and beat every HEARTBEAT_S on `loop` (the event loop)."""
        if self.listen:
            self.auth = bus.PeerAuthenticator(self.ctx, lookup=self.lookup, logger=_log)
            self.auth.start_for()
            self._pub = bus.serve(self.ctx, zmq.PUB, self.listen, self.keys)
            self._pub.sndhwm = 10_000
        if self.peers:
            self._thread = threading.Thread(target=self._listen, name="prefix-share",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        if loop is not None and self._pub is not None:
            self._loop = loop
            self._beat = loop.call_later(HEARTBEAT_S, self._heartbeat)
        _log.info("prefix_share_started", listen=self.listen or "off",
                  peers=",".join(self.peers) or "none")  # fmt: skip

    def publish(self, replica: str, requests: int, work: float, blocks=()) -> None:
        """On the event loop: never blocks (a full queue drops it, counted)."""
        if self._pub is None:
            return
        try:
            self._pub.send(encode(self.name, replica, requests, work, blocks), zmq.NOBLOCK)
        except zmq.ZMQError:
            self.on_count("dropped", 1)
            return
        self.on_count("sent", 1)

    def _heartbeat(self) -> None:
        """Say this router's load on every replica again, so peers know it is alive
        and a long request still counts (with no replica yet: that it is alive)."""
        loads = self.loads() or {"": (0, 0.0)}
        for replica, (requests, work) in loads.items():
            self.publish(replica, requests, work)
        if not self._stop.is_set():
            self._beat = self._loop.call_later(HEARTBEAT_S, self._heartbeat)

    def _listen(self) -> None:
        socks = {}
        poller = zmq.Poller()
        for peer, (endpoint, public) in self.peers.items():
            sock = bus.connect(self.ctx, zmq.SUB, [endpoint], self.keys, public)
            socks[sock] = peer
            poller.register(sock, zmq.POLLIN)
        heard: dict[str, float] = {}  # peer -> when last heard (monotonic)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(200))
                now = time.monotonic()
                for sock in ready:
                    n = 0
                    while True:
                        try:
                            msg = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        got = decode(msg)
                        # A peer speaks for itself only: the name in a message is the
                        # socket's, whatever the message says.
                        if got is None or got[0] != socks[sock]:
                            self.on_count("malformed", 1)
                            continue
                        self.inbox.append(got)
                        heard[got[0]] = now
                        n += 1
                    if n:
                        self.on_count("heard", n)
                for peer in [p for p, at in heard.items() if now - at > PEER_SILENT_S]:
                    del heard[peer]
                    self.inbox.append((peer, None, 0, 0.0, ()))  # forget its work
                    _log.warning("prefix_peer_silent", peer=peer, seconds=PEER_SILENT_S)
        finally:
            for sock in socks:
                sock.close()

    def stop(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.cancel()
        if self._thread is not None:
            self._thread.join(2)
        if self._pub is not None:
            self._pub.close()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
