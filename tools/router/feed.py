"""The scheduler's routing table, received over the bus and applied to the RoutingTable.

A background worker holds a CURVE SUB socket to every configured scheduler. Each
`routes` message is the whole table, so applying it is a plain replace; with no
scheduler reachable, the last table keeps serving.
"""

import os
import queue
import time

import zmq

from llmgw import bus, log
from llmgw.states import ModelState, MsgType, ShardState
from llmgw.worker import Worker
from llmgw_router.routing import Endpoint, RoutingTable

_log = log.get("llmgw.router.feed")

# Schedulers publish the whole table every few seconds (scheduler.snapshot_s, 3 s).
# Silent this long, the connection is likely dead (reconnect), and the router is cut
# off from the control plane: it cannot start a model, so a request for one that has no
# ready replica is answered at once (proxy.py) rather than held for the activation window.
SILENCE_S = 10.0
# How often the schedulers hear which models were used, so idle on-demand models stop.
ACTIVITY_S = 2.0
# How long one pass waits for a message.
POLL_S = 0.2


def endpoints_from(body: dict, static: list[Endpoint] = ()) -> list[Endpoint]:
    """Endpoints for every ready replica in a `routes` body, plus the static ones."""
    eps = list(static)
    for r in body.get("replicas", ()):
        if r.get("state") != ShardState.READY:
            continue
        # LoRA adapters loaded there: a request names one as its model (the engine
        # answers it with the adapter), so the replica serves it by that name too.
        adapters = [n for a in r.get("adapters") or () if isinstance(a, dict)
                    for n in (a.get("name"), *(a.get("aliases") or ())) if n]  # fmt: skip
        models = (r["model"], *r.get("aliases", ()), *adapters)
        eps.append(Endpoint(r["id"], r["endpoint"], models, r.get("key", ""),
                            engine=str(r.get("engine") or "")))  # fmt: skip
    return eps


def _newest(batch: list[bytes]) -> bytes:
    """The table with the highest (epoch, seq) of those that queued up; the last one
    if none can be read (handle() says why)."""
    if len(batch) == 1:
        return batch[0]
    best, best_key = batch[-1], (-1, -1)
    for data in batch:
        try:
            msg = bus.decode(data)
            key = (int(msg.get("epoch", 0)), int(msg["body"].get("seq", 0)))
        except (bus.BusError, TypeError, ValueError, AttributeError):
            continue
        if key >= best_key:
            best, best_key = data, key
    return best


class Feed:
    def __init__(
        self,
        table: RoutingTable,
        schedulers: list[str],
        keys,
        server_public: str,
        static: list[Endpoint] = (),
        apply=None,
        bus_endpoints: list[str] = (),
        name: str = "router",
        curve_dir=None,
    ):
        self.table = table
        # Where scheduler.key and, during a key rotation, scheduler.next.key are.
        self.curve_dir = curve_dir
        self._tried_other = False
        self.schedulers = schedulers
        self.keys = keys
        self.server_public = server_public
        self.static = list(static)
        # Where to apply a new table (endpoints, known model names): on the event loop.
        self.apply = apply or table.replace
        self.seq = -1
        self.epoch = -1
        self._stale_logged = -1
        # The sockets, opened by the worker's first pass and again after a failure or a
        # silence; closed on its thread when it stops.
        self.worker = Worker(
            "routes_feed", self._tick, POLL_S, logger=_log, backoff_max_s=5.0,
            on_failure=lambda e: self._close(), on_stop=self._close,
        )  # fmt: skip
        self._sub = None
        self._handshakes: bus.Handshakes | None = None  # the SUB's: is our key refused?
        self._dealers: list = []
        self._poller: zmq.Poller | None = None
        self._last = 0.0
        # When a scheduler last sent a table we applied (monotonic; the feed's start
        # until one has), and whether we have said that they went silent.
        self.heard_at = time.monotonic()
        self._cut_said = False
        # Called on the feed's thread when the schedulers have been silent SILENCE_S.
        self.on_cut_off = lambda: None
        self._next_activity = 0.0
        self.ctx: zmq.Context | None = None
        # The schedulers' bus sockets, for `want` and `activity` (empty: none sent).
        self.bus_endpoints = list(bus_endpoints)
        self.name = name
        self.last_used: dict[str, float] = {}  # model -> wall time of its last request
        # What else each activity report carries: load for the autoscaler (app.py).
        self.load = dict
        self._wants: queue.SimpleQueue = queue.SimpleQueue()
        # Each want is numbered; the schedulers' tables say, per model, the newest of our
        # wants a placement pass has answered, so a request waits for its own answer.
        self._want_n = 0
        self._last_want: dict[str, int] = {}  # model -> our newest want's number
        self._answered: dict[str, int] = {}  # model or alias -> newest answered number
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def handle(self, data: bytes) -> bool:
        """Apply one message; False if it was not a routes table we could use."""
        try:
            msg = bus.decode(data)
        except bus.BusError as e:
            _log.warning("bad_routes_message", reason=str(e))
            return False
        if msg["type"] != MsgType.ROUTES:
            return False
        body = msg["body"]
        seq = body.get("seq", 0)
        epoch = msg.get("epoch", 0)
        if not isinstance(seq, int) or not isinstance(epoch, int):
            return False
        # Several schedulers may publish: only the leader's newest table counts. A new
        # epoch's table replaces everything (each table is whole, so there is no gap
        # to fill); one from an older epoch is a deposed leader's and is ignored.
        if (epoch, seq) < (self.epoch, self.seq):
            if epoch != self._stale_logged:
                _log.warning("stale_routes_ignored", epoch=epoch, newest=self.epoch)
                self._stale_logged = epoch
            return False
        eps = endpoints_from(body, self.static)
        if (epoch, seq) != (self.epoch, self.seq):
            _log.info("routes_applied", epoch=epoch, seq=seq, endpoints=len(eps))
        self.epoch, self.seq = epoch, seq
        known = {}
        for m in body.get("models", ()):
            status = (m.get("state", ModelState.STARTING), m.get("reason", ""))
            n = (m.get("answered") or {}).get(self.name)
            for name in (m["name"], *m.get("aliases", ())):
                known[name] = status
                if isinstance(n, int):  # before apply: the loop reads it once applied
                    self._answered[name] = max(n, self._answered.get(name, 0))
        self.apply(eps, known)
        self._heard(time.monotonic())
        return True

    # -- wants and activity: the router's side of on-demand models ---------------------

    def want(self, model: str) -> int:
        """Ask the schedulers to bring `model` up now; the want's number, which
        `answered(model)` reaches once a placement pass has answered it. Called on the
        event loop: the feed thread owns the sockets, so hand it over and wake it."""
        self._want_n += 1
        self._last_want[model] = self._want_n
        self._wants.put(model)
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass  # already woken
        return self._want_n

    def silent_s(self, now: float | None = None) -> float:
        """Seconds since a scheduler last sent a table (since the feed started, if none
        has yet): what llmgw_router_table_age_seconds says."""
        return max(0.0, (time.monotonic() if now is None else now) - self.heard_at)

    def cut_off(self, now: float | None = None) -> bool:
        """Whether the schedulers have been silent so long that none can be asked to
        start anything: SILENCE_S (three missed snapshots at the default snapshot_s)."""
        return self.silent_s(now) > SILENCE_S

    def _heard(self, now: float) -> None:
        self.heard_at = now
        if self._cut_said:
            self._cut_said = False
            _log.info("control_plane_reachable", epoch=self.epoch)

    def _check_silence(self, now: float) -> None:
        if not self._cut_said and self.cut_off(now):
            self._cut_said = True
            _log.warning(
                "control_plane_unreachable",
                silent_s=round(self.silent_s(now), 1),
                action="serving the last table; models it cannot start answered 503",
            )
            self.on_cut_off()

    def answered(self, model: str) -> int:
        """The newest of our wants for `model` that a scheduler's pass has answered."""
        return self._answered.get(model, 0)

    def used(self, model: str, now: float) -> None:
        """Note a request for `model` (the request path: one dict store)."""
        self.last_used[model] = now

    def _send(self, dealers, kind: str, body: dict) -> None:
        data = bus.encode(kind, self.name, body)
        for d in dealers:
            try:
                d.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that scheduler is unreachable now; wants are re-sent on demand

    def _send_wants(self, dealers) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        wanted = set()
        while not self._wants.empty():
            wanted.add(self._wants.get_nowait())
        for model in wanted:
            self._send(dealers, MsgType.WANT, {"model": model, "n": self._last_want.get(model, 0)})

    def _send_activity(self, dealers) -> None:
        """Seconds since each model's and each replica's last request (0 while one is
        being answered): relative, so clocks need not agree."""
        if self.last_used:
            now = time.time()
            idle = {m: round(max(0.0, now - t), 3) for m, t in list(self.last_used.items())}
            mono = time.monotonic()
            replicas = {
                ep.id: 0.0 if ep.outstanding else round(max(0.0, mono - ep.last_used), 3)
                for ep in self.table.endpoints()
                if ep.last_used or ep.outstanding
            }
            body = {"idle_s": idle, "replica_idle_s": replicas, **self.load()}
            self._send(dealers, MsgType.ACTIVITY, body)
        # Ask again for what requests still wait on: a want can be lost (a scheduler
        # restarting, a failover) and the request would wait out its window for nothing.
        for model in self.table.waited_for():
            self._send(dealers, MsgType.WANT, {"model": model, "n": self._last_want.get(model, 0)})

    # -- the worker ------------------------------------------------------------------------

    def _open(self) -> None:
        self._sub = bus.connect(self.ctx, zmq.SUB, self.schedulers, self.keys, self.server_public)
        self._dealers = [
            bus.connect(self.ctx, zmq.DEALER, [ep], self.keys, self.server_public,
                        identity=self.name)
            for ep in self.bus_endpoints
        ]  # fmt: skip
        if self._handshakes is None:
            self._handshakes = bus.Handshakes(self._sub)
        else:
            self._handshakes.follow(self._sub)  # what was said stays said
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._last = time.monotonic()
        self._next_activity = self._last + ACTIVITY_S

    def _switch_key(self) -> bool:
        """Reconnect with the other trusted scheduler key, if there is one."""
        if self.curve_dir is None:
            return False
        other = bus.other_key(self.curve_dir, self.server_public)
        if other is None or other == self.server_public:
            return False
        self.server_public = other
        self._close()
        self._handshakes.forget()
        _log.info("scheduler_key_tried", public_key=other[:8])
        return True

    def _close(self) -> None:
        if self._sub is not None:
            self._handshakes.close()
            self._sub.close(0)
        for d in self._dealers:
            d.close(0)
        self._sub, self._dealers, self._poller = None, [], None

    def _tick(self) -> float:
        """Apply tables and pass on wants for one poll. After the schedulers have been
        silent so long that the connection is likely dead, start afresh: libzmq never
        retries a connection the server refused (say, while this router's key was not
        yet registered)."""
        if self._sub is None:
            self._open()
        sub, dealers = self._sub, self._dealers
        events = dict(self._poller.poll(POLL_S * 1000))
        now = time.monotonic()
        news = self._handshakes.news()
        if news is not None and news[0] == "accepted":
            self._tried_other = False
        if news is not None and news[0] == "refused":
            reason = news[1]
            if reason != bus.NOT_REGISTERED and not self._tried_other:
                # Handshakes fail: a key rotation may be under way. Try the other
                # trusted key (scheduler.next.key) before calling it a refusal.
                self._tried_other = True
                if self._switch_key():
                    return 0.0
            # Refused is not silent: say why, once, rather than "unreachable".
            if reason == bus.NOT_REGISTERED:
                reason += f" ({bus.copy_hint(self.name, 'routers')})"
            _log.warning("scheduler_refused", reason=reason)
        if self._wake_r in events:
            self._send_wants(dealers)
        if now >= self._next_activity:
            self._send_activity(dealers)
            self._next_activity = now + ACTIVITY_S
        if sub not in events:
            self._check_silence(now)
            if now - self._last > SILENCE_S:
                if self._handshakes.refused is None:  # a refusal was said once already
                    _log.warning("schedulers_silent", seconds=SILENCE_S, action="reconnecting")
                elif self.curve_dir is not None:  # keys copied since: try the other one
                    self.server_public = (
                        bus.other_key(self.curve_dir, self.server_public) or self.server_public
                    )
                self._close()
            return 0.0
        # Only the newest table matters: skip any that queued up behind it (handle()
        # ignores a deposed leader's, whichever order they came in).
        batch = [sub.recv()]
        while sub.poll(0):
            batch.append(sub.recv())
        self._last = now
        if not self.handle(_newest(batch)):
            self._check_silence(now)
        return 0.0

    def start(self) -> None:
        self.ctx = zmq.Context()
        self.heard_at = time.monotonic()
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        if self.ctx is not None:
            self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
