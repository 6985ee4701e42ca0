"""The scheduler's routing table, received over the bus and applied to the RoutingTable.

A background thread holds a CURVE SUB socket to every configured scheduler. Each
`routes` message is the whole table, so applying it is a plain replace; with no
scheduler reachable, the last table keeps serving.
"""

import threading
import time

import zmq

from llmgw import bus, log
from llmgw_router.routing import Endpoint, RoutingTable

_log = log.get("llmgw.router.feed")

# Schedulers publish the whole table every few seconds (scheduler.snapshot_s, 3 s).
SILENCE_S = 10.0


def endpoints_from(body: dict, static: list[Endpoint] = ()) -> list[Endpoint]:
    """Endpoints for every ready replica in a `routes` body, plus the static ones."""
    eps = list(static)
    for r in body.get("replicas", ()):
        if r.get("state") != "ready":
            continue
        models = (r["model"], *r.get("aliases", ()))
        eps.append(Endpoint(r["id"], r["endpoint"], models, r.get("key", "")))
    return eps


class Feed:
    def __init__(
        self,
        table: RoutingTable,
        schedulers: list[str],
        keys,
        server_public: str,
        static: list[Endpoint] = (),
        apply=None,
    ):
        self.table = table
        self.schedulers = schedulers
        self.keys = keys
        self.server_public = server_public
        self.static = list(static)
        # Where to apply a new table (endpoints, known model names): on the event loop.
        self.apply = apply or table.replace
        self.seq = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ctx: zmq.Context | None = None

    def handle(self, data: bytes) -> bool:
        """Apply one message; False if it was not a routes table we could use."""
        try:
            msg = bus.decode(data)
        except bus.BusError as e:
            _log.warning("bad_routes_message", reason=str(e))
            return False
        if msg["type"] != "routes":
            return False
        body = msg["body"]
        seq = body.get("seq", 0)
        eps = endpoints_from(body, self.static)
        if seq != self.seq:
            _log.info("routes_applied", seq=seq, endpoints=len(eps))
        self.seq = seq
        known = {}
        for m in body.get("models", ()):
            status = (m.get("state", "starting"), m.get("reason", ""))
            for name in (m["name"], *m.get("aliases", ())):
                known[name] = status
        self.apply(eps, known)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            sock = bus.connect(self.ctx, zmq.SUB, self.schedulers, self.keys, self.server_public)
            try:
                self._listen(sock)
            finally:
                sock.close(0)

    def _listen(self, sock) -> None:
        """Apply tables until stopped, or until the schedulers have been silent so long
        that the connection is likely dead: libzmq never retries a connection the server
        refused (say, while this router's key was not yet registered), so start afresh."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        last = time.monotonic()
        while not self._stop.is_set():
            if not poller.poll(200):
                if time.monotonic() - last > SILENCE_S:
                    _log.warning("schedulers_silent", seconds=SILENCE_S, action="reconnecting")
                    return
                continue
            data = sock.recv()
            # Only the newest table matters: skip any that queued up behind it.
            while poller.poll(0):
                data = sock.recv()
            last = time.monotonic()
            self.handle(data)

    def start(self) -> None:
        self.ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="routes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self.ctx is not None:
            self.ctx.term()
