"""The usage rows checked against the engines' own counters: the store's side of the
comparison (counters.py has the engines' side and the arithmetic), the thread that
keeps the `llmgw_usage_*` gauges, and `GET /v1/usage/reconcile` of the admin API.

Only the leader publishes the gauges (a standby keeps the engines' readings too, from
the same heartbeats, so it can after a takeover). Each check reads two sums per replica
from the store, over the index on (endpoint, at), on the worker's own connection and
never under the scheduler's lock.
"""

import time

import peewee
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from llmgw import log
from llmgw.config import UsageConfig
from llmgw.errors import Invalid
from llmgw.store import Usage
from llmgw.worker import Worker
from llmgw_scheduler.counters import KINDS, Point, Tally, compare, window

_log = log.get("llmgw.scheduler.usage_check")

CHECK_EVERY_S = 60.0
# A row's prompt is placed at its start plus its time to first token; rows are looked
# for this far past the window's end (a request that ran longer is not found).
SLACK_S = 3600.0


def router_tally(replica: str, t0: float, t1: float) -> Tally:
    """What the usage rows bill to `replica` over (t0, t1] (counters.py says how a row
    is placed in time)."""
    started = Usage.at - Usage.latency_ms / 1000.0 + peewee.fn.COALESCE(Usage.ttft_ms, 0) / 1000.0
    mine = Usage.endpoint == replica
    prompt, cached, requests = (
        Usage.select(
            peewee.fn.COALESCE(peewee.fn.SUM(Usage.prompt_tokens), 0),
            peewee.fn.SUM(Usage.cached_tokens),
            peewee.fn.COUNT(Usage.id),
        )
        .where(
            mine & (Usage.at > t0) & (Usage.at <= t1 + SLACK_S) & (started > t0) & (started <= t1)
        )
        .tuples()
        .first()
    )
    completion = (
        Usage.select(peewee.fn.COALESCE(peewee.fn.SUM(Usage.completion_tokens), 0))
        .where(mine & (Usage.at > t0) & (Usage.at <= t1))
        .scalar()
    )
    return Tally(
        int(prompt), int(completion or 0), None if cached is None else int(cached), int(requests)
    )


def reconcile(snapshot: dict[str, tuple[str, list[Point]]], since: float, until: float):
    """One line per replica with readings that bound part of (since, until], by model
    and replica."""
    out = []
    for rid, (model, points) in sorted(snapshot.items(), key=lambda kv: (kv[1][0], kv[0])):
        bounds = window(points, since, until)
        if bounds is None:
            continue
        start, end = bounds
        out.append(compare(rid, model, start, end, router_tally(rid, start.at, end.at)))
    return out


class UsageCheck:
    """Compares every replica over the last `reconcile_window_s` each minute, for the
    gauges."""

    def __init__(self, sched, cfg: UsageConfig, db, clock=time.time):
        self.sched = sched
        self.cfg = cfg
        self.clock = clock
        self.latest: list[dict] = []
        self.leading = False
        self.worker = Worker("usage_check", self.tick, CHECK_EVERY_S, db=db, logger=_log)

    def tick(self) -> None:
        now = self.clock()
        s = self.sched
        with s.lock:
            s.engine_counters.trim(now)
            self.leading = s.leading()
            snapshot = s.engine_counters.snapshot() if self.leading else {}
        if not self.leading:
            self.latest = []
            return
        until = now - self.cfg.reconcile_settle_s
        self.latest = reconcile(snapshot, until - self.cfg.reconcile_window_s, until)

    def collect(self):
        """The gauges, from the newest check (a prometheus_client collector)."""
        if not self.leading:
            return
        threshold = GaugeMetricFamily(
            "llmgw_usage_reconcile_threshold_ratio",
            "usage.reconcile_threshold: how far (a fraction of the engine's count) the usage"
            " rows may differ from an engine's counters before UsageDisagreesWithEngines",
        )
        threshold.add_metric([], self.cfg.reconcile_threshold)
        router = GaugeMetricFamily(
            "llmgw_usage_router_tokens",
            "Tokens the routers' usage rows bill to a replica over the check's window",
            labels=["model", "replica", "kind"],
        )
        engine = GaugeMetricFamily(
            "llmgw_usage_engine_tokens",
            "Tokens a replica's engine counted over the check's window (its own counters)",
            labels=["model", "replica", "kind"],
        )
        ratio = GaugeMetricFamily(
            "llmgw_usage_difference_ratio",
            "(usage rows - engine) / engine over the check's window, per replica; only with"
            " at least usage.reconcile_min_tokens of the kind",
            labels=["model", "replica", "kind"],
        )
        for line in self.latest:
            for kind in KINDS:
                key = [line["model"], line["replica"], kind]
                router.add_metric(key, line["router"][kind])
                engine.add_metric(key, line["engine"][kind])
                r = line["ratio"][kind]
                if r is not None and line["engine"][kind] >= self.cfg.reconcile_min_tokens:
                    ratio.add_metric(key, r)
        yield from (threshold, router, engine, ratio)

    def describe(self):
        return []

    def start(self, registry=REGISTRY) -> None:
        registry.register(self)
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()


def usage_reconcile(h):
    """`GET /v1/usage/reconcile?since=T[&until=T]`: the comparison per replica, over
    (since, until]; `until` defaults to now less usage.reconcile_settle_s."""
    cfg = h.cfg.usage if h.cfg is not None else UsageConfig()
    now = time.time()
    try:
        until = float(h.q.get("until", now - cfg.reconcile_settle_s))
        since = float(h.q.get("since", until - 3600.0))
    except ValueError:
        raise Invalid("since and until must be Unix times") from None
    if since >= until:
        raise Invalid("since must be before until")
    s = h.sched
    with s.lock:
        snapshot = s.engine_counters.snapshot()
    replicas = reconcile(snapshot, since, until)
    return 200, {
        "since": since,
        "until": until,
        "threshold": cfg.reconcile_threshold,
        "replicas": replicas,
    }
