"""The engines' own word on how busy they are, read off the request path.

A background worker asks every endpoint each `router.engine_probe_s` for its engine's
load signal, read by the engine's own reader (llmgw.engines: llama-server's `GET
/slots`, its slots and which are processing; vLLM's `GET /metrics`, requests running
and waiting), the one the agent drains by. An endpoint whose engine the routing table
does not name, or names but is not registered, is asked for each registered engine's
signal in turn, the one that answered first being asked first from then on. Admission
then counts slots busy with other routers' requests, and treats an engine that queues
requests itself as full. An engine that answers none is asked again only every
`RETRY_S`; a probe older than `STALE_S` is ignored, so a dead probe never blocks
admission.
"""

import time
import urllib.error
import urllib.request

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from llmgw import engines, log
from llmgw.worker import Worker
from llmgw_router.routing import SIGNAL_STALE_S as STALE_S
from llmgw_router.routing import Endpoint, RoutingTable

_log = log.get("llmgw.router.probe")

RETRY_S = 60.0
TIMEOUT_S = 1.0
# An engine that has answered before and then does not (a timeout: busy on a loaded
# core, the moment its load matters most) is asked again at the next pass, this many
# times in a row, before it counts as one without a signal for RETRY_S. Its last word
# stands meanwhile until it is stale (routing.SIGNAL_STALE_S).
TRANSIENT_FAILURES = 3


class Signal:
    """What an engine last said: its slots and how many are busy, or how many requests
    it has waiting (vLLM), and when."""

    __slots__ = ("slots", "busy", "waiting", "at", "ctx", "own")

    def __init__(self, slots: int = 0, busy: int = 0, waiting: int = 0, at: float = 0.0,
                 ctx: int = 0, own: int | None = None):  # fmt: skip
        self.slots, self.busy, self.waiting, self.at = slots, busy, waiting, at
        self.ctx = ctx  # tokens of context over every slot (its prompt cache), 0: unknown
        # This router's requests on the engine when it answered (None: not noted).
        self.own = own


def capacity(eps: list[Endpoint], slots: int, mono: float, wall: float) -> int | None:
    """Requests this router may have in flight on a model served by `eps`, each with
    `slots` (0: unknown), skipping endpoints in cooldown: the engine's own slot count
    less slots busy with other routers' requests, where it gives one; only what is
    already in flight on an engine that queues requests itself. None: unbounded, or
    every endpoint is cooling down (queueing will not help: the request is told when to
    come back at once)."""
    total, counted = 0, False
    for ep in eps:
        if ep.cooldown_until > mono:
            continue
        counted = True
        sig = ep.signal
        if sig is not None and wall - sig.at <= STALE_S:
            if sig.waiting > 0:
                total += ep.outstanding
                continue
            if sig.slots:
                foreign = sig.busy - ep.outstanding
                total += sig.slots - foreign if foreign > 0 else sig.slots
                continue
        if slots <= 0:
            return None  # nothing says how much it takes: never saturated
        total += slots
    return total if counted else None


def replica_load(eps: list[Endpoint], slots_of, wall: float) -> dict[str, list[int]]:
    """Per endpoint, [requests this router has in flight on it, its slots]: the
    engine's own slot count where it gave one lately, else `slots_of(ep)` (the model's
    `parallel`). The scheduler sums the first over routers, for its autoscaler."""
    out = {}
    for ep in eps:
        sig = ep.signal
        fresh = sig is not None and sig.slots and wall - sig.at <= STALE_S
        out[ep.id] = [ep.outstanding, sig.slots if fresh else slots_of(ep)]
    return out


NONE = ""  # an endpoint none of whose signal sources answered


class EngineLoadCollector:
    """`llmgw_router_engine_requests{endpoint,state}`: what each engine said at its last
    probe (requests running, waiting), every router's together; none for an engine whose
    word is older than STALE_S, as routing ignores it then. Read at scrape time, so an
    endpoint that left the table leaves the metric with it. One per process (the
    registry's): the router's Probe points it at its table."""

    def __init__(self, clock=time.time):
        self.table: RoutingTable | None = None
        self.clock = clock

    def describe(self):
        yield GaugeMetricFamily("llmgw_router_engine_requests", "", labels=["endpoint", "state"])

    def collect(self):
        g = GaugeMetricFamily(
            "llmgw_router_engine_requests",
            "Requests each engine said it runs or queues at its last load probe, every "
            "router's together (none: its word is stale or it gives none)",
            labels=["endpoint", "state"],
        )
        now = self.clock()
        for ep in self.table.endpoints() if self.table is not None else ():
            sig = ep.signal
            if sig is not None and now - sig.at <= STALE_S:
                g.add_metric([ep.id, "running"], sig.busy)
                g.add_metric([ep.id, "waiting"], sig.waiting)
        yield g


ENGINE_LOAD = EngineLoadCollector()  # registered by the first Probe: a serving router's


class Probe:
    def __init__(self, table: RoutingTable, interval_s: float, on_change=None, clock=time.time):
        self.table = table
        if ENGINE_LOAD.table is None:
            REGISTRY.register(ENGINE_LOAD)
        ENGINE_LOAD.table = table
        self.interval_s = interval_s
        self.on_change = on_change or (lambda: None)  # called (from the thread) after a pass
        self.clock = clock
        # endpoint id -> (the engine whose signal it answered, or NONE; since)
        self._kind: dict[str, tuple[str, float]] = {}
        self._failures: dict[str, int] = {}  # endpoint id -> passes in a row it did not answer
        # A failing pass never takes the router down: said once, retried with backoff.
        self.worker = Worker("engine_probe", self.tick, interval_s, logger=_log)

    def _get(self, ep: Endpoint, path: str) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {ep.key}"} if ep.key else {}
        req = urllib.request.Request(ep.url + path, headers=headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=TIMEOUT_S) as r:
                return r.status, r.read(1 << 20)
        except urllib.error.HTTPError as e:
            return e.code, b""

    def probe(self, ep: Endpoint, now: float) -> None:
        kind, since = self._kind.get(ep.id, (None, 0.0))
        if kind == NONE and now - since < RETRY_S:
            return
        sources = engines.signal_sources(ep.engine or None)
        sources.sort(key=lambda e: e.name != kind)  # the one that answered before first
        try:
            for engine in sources:
                own = ep.outstanding  # as the engine answered: its busy slots include them
                status, body = self._get(ep, engine.load_path)
                load = engines.read_load(engine, status, body)
                if load is not None:
                    ep.signal = Signal(load.slots, load.running, load.waiting, now, load.ctx, own)
                    self._kind[ep.id] = (engine.name, now)
                    self._failures.pop(ep.id, None)
                    return
        except OSError:
            # Down or not answering in time: routing's own cooldowns deal with a dead one.
            # One that answered before is asked again next pass (seen: a vLLM streaming on
            # two busy cores missed one probe, and its load went unread for a minute).
            failures = self._failures[ep.id] = self._failures.get(ep.id, 0) + 1
            if kind and failures < TRANSIENT_FAILURES:
                return
        except ValueError:
            pass
        self._failures.pop(ep.id, None)
        ep.signal = None
        if kind != NONE:
            _log.info("engine_signal_unavailable", endpoint=ep.id, action="slots from config")
        self._kind[ep.id] = (NONE, now)

    def tick(self) -> None:
        now = self.clock()
        for ep in self.table.endpoints() if self.table is not None else ():
            self.probe(ep, now)
        self.on_change()

    def start(self) -> None:
        if self.interval_s > 0:
            self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
