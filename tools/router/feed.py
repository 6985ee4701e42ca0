"""The scheduler's routing table, received over the bus and applied to the RoutingTable.

A background worker holds a CURVE SUB socket to every configured scheduler. A `routes`
message is the whole table; a `routes_diff` says what changed since the table of a
given version (tools/scheduler/published.py). A router that holds that version applies
the diff and needs no whole table: it subscribes to diffs only, so the whole table
(8.9 MB at 50,000 replicas, every change and every 3 s) is not even sent to it. A diff
that does not start from the table held means a message was missed: the router
subscribes to whole tables again and serves the table it holds until the next one.
With no scheduler reachable, the last table keeps serving.
"""

import gc
import os
import queue
import time
from contextlib import contextmanager

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
# What the SUB subscribes to: diffs always, whole tables until it holds one it can
# follow with diffs.
WHOLE, DIFF = bus.topic(MsgType.ROUTES), bus.topic(MsgType.ROUTES_DIFF)


def _models(r: dict) -> tuple[str, ...]:
    # LoRA adapters loaded there: a request names one as its model (the engine
    # answers it with the adapter), so the replica serves it by that name too.
    adapters = r.get("adapters")
    if not adapters:
        return (r["model"], *r.get("aliases", ()))
    names = [n for a in adapters if isinstance(a, dict)
             for n in (a.get("name"), *(a.get("aliases") or ())) if n]  # fmt: skip
    return (r["model"], *r.get("aliases", ()), *names)


def _endpoint(r: dict, models: tuple[str, ...]) -> Endpoint:
    return Endpoint(r["id"], r["endpoint"], models, r.get("key", ""),
                    engine=str(r.get("engine") or ""))  # fmt: skip


def endpoints_from(body: dict, static: list[Endpoint] = ()) -> list[Endpoint]:
    """Endpoints for every ready replica in a `routes` body, plus the static ones."""
    eps = list(static)
    for r in body.get("replicas", ()):
        if r.get("state") == ShardState.READY:
            eps.append(_endpoint(r, _models(r)))
    return eps


class Replicas:
    """The scheduler's replicas as this router holds them: an Endpoint for each, kept
    while what it was made from (endpoint, models, key, engine) stays the same. The
    table keeps an endpoint that stays anyway (its counters); building 50,000 anew,
    only to drop them, was a third of applying a big table."""

    def __init__(self):
        self.eps: dict[str, Endpoint] = {}
        self._made: dict[str, tuple] = {}  # id -> what its Endpoint was made from

    def _put(self, r: dict, eps: dict, made: dict) -> None:
        rid = r["id"]
        # As they came: comparing these is cheaper than making the models tuple.
        what = (r["endpoint"], r["model"], r.get("aliases"), r.get("adapters"),
                r.get("key", ""), r.get("engine"))  # fmt: skip
        ep = self.eps.get(rid)
        if ep is None or self._made.get(rid) != what:
            ep = _endpoint(r, _models(r))
        eps[rid], made[rid] = ep, what

    def replace(self, replicas) -> None:
        """Hold exactly the ready replicas of a whole table."""
        eps, made = {}, {}
        for r in replicas:
            if r.get("state") == ShardState.READY:
                self._put(r, eps, made)
        self.eps, self._made = eps, made

    def update(self, replicas, removed) -> None:
        """Apply a diff: replicas added or changed (one no longer ready is gone), and
        the ids of those removed."""
        eps, made = dict(self.eps), dict(self._made)
        for rid in removed:
            eps.pop(rid, None)
            made.pop(rid, None)
        for r in replicas:
            if r.get("state") == ShardState.READY:
                self._put(r, eps, made)
            else:
                eps.pop(r["id"], None)
                made.pop(r["id"], None)
        self.eps, self._made = eps, made


@contextmanager
def _no_gc():
    """The cyclic garbage collector off meanwhile. Decoding a big table makes hundreds
    of thousands of dicts, lists and strings, and none of them in a cycle; yet every
    700 new containers the collector ran, and now and then it walked the whole heap:
    that was up to half the time of applying 50,000 replicas (bench/SCHEDULER.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


def _to_apply(batch: list[bytes]) -> list[bytes]:
    """What to apply of the messages that queued up, in order: every diff (each starts
    from the one before), and of the whole tables only the newest."""
    wholes = [data for data in batch if not data.startswith(DIFF)]
    if len(wholes) < 2:
        return batch
    newest = _newest(wholes)
    return [data for data in batch if data.startswith(DIFF) or data is newest]


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
        # The table held, as diffs name it (published.py): lineage None when it came
        # from a scheduler that sends no diffs.
        self.lineage: str | None = None
        self.version = 0
        self.replicas = Replicas()
        self.known: dict[str, tuple[str, str]] = {}
        self._whole_wanted = True  # subscribed to whole tables
        self.applied = {"whole": 0, "diff": 0}  # tables applied each way, for the curious
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
        """Apply one message; False if it was not a table or a diff we could use. One
        applied is word from the control plane (a deposed leader's is not)."""
        with _no_gc():
            applied = self._handle(data)
        if applied:
            self._heard(time.monotonic())
        return applied

    def _handle(self, data: bytes) -> bool:
        try:
            msg = bus.decode(data)
        except bus.BusError as e:
            _log.warning("bad_routes_message", reason=str(e))
            return False
        if msg["type"] not in (MsgType.ROUTES, MsgType.ROUTES_DIFF):
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
        if msg["type"] == MsgType.ROUTES_DIFF:
            return self._diff(body, epoch, seq)
        self.replicas.replace(body.get("replicas", ()))
        self.known = self._known_from(body.get("models", ()))
        if (epoch, seq) != (self.epoch, self.seq):
            _log.info("routes_applied", epoch=epoch, seq=seq, endpoints=len(self.replicas.eps))
        self.epoch, self.seq = epoch, seq
        table, version = body.get("table"), body.get("version")
        if isinstance(table, str) and isinstance(version, int):
            self.lineage, self.version = table, version
            self._whole(False)  # diffs will follow this one
        else:  # a scheduler that sends no diffs: keep taking whole tables
            self.lineage, self.version = None, 0
            self._whole(True)
        self.applied["whole"] += 1
        self._install()
        return True

    def _diff(self, body: dict, epoch: int, seq: int) -> bool:
        """Apply a diff if it starts from the table held; otherwise take whole tables
        again until one comes (the table held keeps serving meanwhile)."""
        table, version, base = body.get("table"), body.get("version"), body.get("base")
        replicas, removed = body.get("replicas"), body.get("removed")
        if not (isinstance(version, int) and isinstance(replicas, list)
                and isinstance(removed, list)):  # fmt: skip
            return False
        if table != self.lineage or base != self.version:
            if table == self.lineage and version <= self.version:
                return False  # one applied already (two paths to one scheduler)
            if not self._whole_wanted:
                _log.info("routes_diff_skipped", held=self.version, base=base,
                          action="waiting for the whole table")  # fmt: skip
            self._whole(True)
            return False
        self.epoch, self.seq, self.version = epoch, seq, version
        self.applied["diff"] += 1
        if "models" in body:
            self.known = self._known_from(body["models"] or ())
        if replicas or removed or "models" in body:
            self.replicas.update(replicas, removed)
            _log.info("routes_applied", epoch=epoch, seq=seq, endpoints=len(self.replicas.eps),
                      changed=len(replicas), removed=len(removed))  # fmt: skip
            self._install()
        return True

    def _known_from(self, models) -> dict:
        """The catalog's models and aliases -> (state, reason); notes which of our
        wants each answers."""
        known = {}
        for m in models:
            status = (m.get("state", ModelState.STARTING), m.get("reason", ""))
            n = (m.get("answered") or {}).get(self.name)
            for name in (m["name"], *m.get("aliases", ())):
                known[name] = status
                if isinstance(n, int):  # before apply: the loop reads it once applied
                    self._answered[name] = max(n, self._answered.get(name, 0))
        return known

    def _install(self) -> None:
        self.apply([*self.static, *self.replicas.eps.values()], self.known)

    def _whole(self, wanted: bool) -> None:
        """Subscribe to whole tables, or stop (the socket's filter: at the publisher)."""
        if wanted != self._whole_wanted and self._sub is not None:
            self._sub.setsockopt(zmq.SUBSCRIBE if wanted else zmq.UNSUBSCRIBE, WHOLE)
        self._whole_wanted = wanted

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
        # A fresh connection may have missed diffs: whole tables until one comes.
        self._whole_wanted = True
        self._sub = bus.connect(self.ctx, zmq.SUB, self.schedulers, self.keys, self.server_public,
                                topics=(DIFF, WHOLE))  # fmt: skip
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
        # Only the newest whole table matters: skip any that queued up behind it
        # (handle() ignores a deposed leader's, whichever order they came in).
        batch = [sub.recv()]
        while sub.poll(0):
            batch.append(sub.recv())
        self._last = now
        applied = False
        for data in _to_apply(batch):
            applied = self.handle(data) or applied
        if not applied:
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
