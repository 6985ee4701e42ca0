"""What the status page and the `llmgw_usage_recent_*` gauges show of the routers'
traffic, read from the store by one background thread every `scheduler.status_refresh_s`.

The routers already write a usage row per request (status, tokens, latency, time to
first token, key, project, team) to the store in batches; nothing on the request path
changes for the page. Each pass sums the rows of the minutes since the last pass (and a
few before it, for rows a router flushed late) per minute and model in the store, and
the hour's and the day's usage per key, project and team (usage.report). The first pass
reads the whole last day, so the charts are whole after a restart or a takeover.

It is the only reader: page views and scrapes read what it kept, never the store, and
the scheduler's lock is held only to read the catalog's names.
"""

import threading
import time

import peewee
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from llmgw import log
from llmgw import usage as usagemod
from llmgw.errors import ConfigError
from llmgw.store import Usage
from llmgw.worker import Worker
from llmgw_scheduler.traffic import DAY_S, Minute, Traffic, canonical

_log = log.get("llmgw.scheduler.readings")

# Minutes read again at each pass: routers flush their usage every second, and a router
# that could not reach the store writes its spool when it can; rows later than this are
# in `llmgw usage` but not in the charts.
REREAD_S = 300.0
WINDOWS = {"hour": 3600.0, "day": DAY_S}
BY = ("key", "project", "team")
# Per `by` and window, the gauges name the largest users; the rest are summed as one.
GAUGE_TOP = 20


def check_refresh(cfg) -> None:
    """A refresh of 0 or less would read the store in a loop."""
    if not cfg.scheduler.status_refresh_s > 0:
        raise ConfigError(
            f"scheduler.status_refresh_s ({cfg.scheduler.status_refresh_s:g}) must be > 0"
        )


def read_minutes(since: float, by_alias: dict[str, str]) -> dict[int, dict[str, Minute]]:
    """The usage rows from `since` on, summed per minute and model (what answered, else
    what was asked for), in the store: one row per minute and model comes back."""
    # CAST to an integer, then integer division: portable between SQLite and PostgreSQL
    # (which rounds the cast where SQLite truncates: a row half a second before a minute
    # boundary may count in the next minute there).
    minute = peewee.Cast(Usage.at, "BIGINT") / 60
    name = peewee.fn.COALESCE(Usage.served_model, Usage.model)
    status = Usage.status

    def count(cond):
        return peewee.fn.SUM(peewee.Case(None, [(cond, 1)], 0))

    q = (
        Usage.select(
            minute,
            name,
            peewee.fn.COUNT(Usage.id),
            count((status >= 400) & (status < 500)),
            count(status >= 500),
            peewee.fn.SUM(Usage.ttft_ms),
            peewee.fn.COUNT(Usage.ttft_ms),
            peewee.fn.SUM(Usage.completion_tokens),
        )  # fmt: skip
        .where(Usage.at >= since)
        .group_by(minute, name)
        .tuples()
    )
    out: dict[int, dict[str, Minute]] = {}
    for m, model, n, client, errors, ttft, ttft_n, tokens in q:
        models = out.setdefault(int(m) * 60, {})
        key = canonical(model, by_alias)
        got = Minute(int(n), int(client or 0), int(errors or 0), float(ttft or 0.0),
                     int(ttft_n or 0), int(tokens or 0))  # fmt: skip
        models[key] = models[key] + got if key in models else got
    return out


class Readings:
    def __init__(self, sched, db, every_s: float, clock=time.time):
        self.sched = sched
        self.clock = clock
        self.every_s = every_s
        self.traffic = Traffic()
        # (by, window) -> usage.report rows; when they were read (None: not yet).
        self.usage: dict[tuple[str, str], list[dict]] = {}
        self.usage_at: float | None = None
        self.lock = threading.Lock()  # the page's and the scrape's reads against a pass
        self.worker = Worker("status_readings", self.tick, every_s, db=db, logger=_log,
                             backoff_max_s=max(every_s, 60.0))  # fmt: skip

    def tick(self) -> None:
        now = self.clock()
        with self.sched.lock:
            by_alias = dict(self.sched.catalog.by_alias)
        read_at = self.traffic.read_at
        since = now - DAY_S if read_at is None else read_at - REREAD_S
        minutes = read_minutes(since, by_alias)
        usage = {
            (by, window): usagemod.report(by, now - span, now)
            for by in BY
            for window, span in WINDOWS.items()
        }
        with self.lock:
            self.traffic.replace(since, minutes, now)
            self.usage, self.usage_at = usage, now

    def snapshot(self):
        """(a copy of the traffic, the usage reports, when they were read) for a page."""
        with self.lock:
            t = Traffic(self.traffic.keep_s)
            t.minutes = {m: dict(v) for m, v in self.traffic.minutes.items()}
            t.read_at = self.traffic.read_at
            return t, dict(self.usage), self.usage_at

    def collect(self):
        """Tokens and requests per key, project and team over the last hour and day, as
        gauges (the leader's only, like the fleet's series)."""
        with self.sched.lock:
            leading = self.sched.leading()
        with self.lock:
            usage = dict(self.usage)
        if not leading or not usage:
            return
        tokens = GaugeMetricFamily(
            "llmgw_usage_recent_tokens",
            "Tokens (prompt + completion) in the last hour or day, per key, project or team:"
            f' the {GAUGE_TOP - 1} largest of each, the rest as name="others"',
            labels=["by", "name", "window"],
        )
        requests = GaugeMetricFamily(
            "llmgw_usage_recent_requests",
            "Requests in the last hour or day, per key, project or team (as the tokens)",
            labels=["by", "name", "window"],
        )
        for (by, window), rows in sorted(usage.items()):
            for name, t, n in top(rows, by, GAUGE_TOP):
                tokens.add_metric([by, name, window], t)
                requests.add_metric([by, name, window], n)
        yield from (tokens, requests)

    def describe(self):
        return []

    def start(self, registry=REGISTRY) -> None:
        registry.register(self)
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()


def top(rows: list[dict], by: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, tokens, requests) of the `limit` - 1 largest by tokens, and the rest summed
    as "others"; a row without a name (no key, project or team) as "none"."""
    out = [(str(r[by]) if r[by] is not None else "none",
            r["prompt_tokens"] + r["completion_tokens"], r["requests"]) for r in rows]  # fmt: skip
    out.sort(key=lambda x: (-x[1], x[0]))
    if len(out) > limit:
        rest = out[limit - 1 :]
        out = [*out[: limit - 1], ("others", sum(x[1] for x in rest), sum(x[2] for x in rest))]
    return out
