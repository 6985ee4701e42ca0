"""The engines' token counters over time, and the usage rows compared with them: what
`llmgw usage reconcile` and the `llmgw_usage_*` gauges say. Pure: readings, windows and
tallies in, numbers out; the clock and the store are the caller's (usage_check.py).

Agents send each serving engine's cumulative counters with every heartbeat
(`tools/agentd/counters.py`). An engine's counters begin again at 0 when its process
does, so each replica's readings are kept as running totals that never go back: a
reading from a new process (or one lower than the last) adds what it says since that
start, as Prometheus's `increase()` does. What the old process counted after its last
reading is lost to the engine's side.

The rows' side of a window (t0, t1], both ends being readings of that replica:

- completion tokens of the rows that ended in it (`at`): llama-server counts a
  request's generated tokens when its slot is released, at the answer's end;
- prompt tokens of the rows whose prompt was evaluated in it: the engine counts them
  as it evaluates them, before the first token, so a row's prompt is placed at its
  start plus its time to first token (its start, for a whole answer).

A request still running at t1 is counted on the engine's side and not yet on the
rows': the window ends `settle_s` before now, so the requests under way then have ended
and been written before it is compared.
"""

import bisect
import math
from collections import deque
from dataclasses import dataclass

# Readings kept as they came for this long; before that, one a minute; none older than
# KEEP_S (`--since 1d` works on a scheduler up for a day).
FINE_S = 1200.0
COARSE_S = 60.0
KEEP_S = 25 * 3600.0
KINDS = ("prompt", "completion")


@dataclass(frozen=True, slots=True)
class Reading:
    """One reading of an engine's counters, as its agent sent it."""

    at: float
    prompt: int  # every prompt token it took, cached ones included
    cached: int | None  # of which reused from its cache (None: it does not say)
    generated: int
    process: str  # the engine process: another one began its counters at 0

    @classmethod
    def of(cls, tokens: dict) -> "Reading | None":
        """A heartbeat's `tokens` for a shard; None if it is not one."""
        try:
            cached = tokens.get("cached")
            return cls(
                float(tokens["at"]),
                int(tokens["prompt"]),
                None if cached is None else int(cached),
                int(tokens["generated"]),
                str(tokens.get("process", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


@dataclass(frozen=True, slots=True)
class Point:
    """Running totals since the replica's first reading here, at a reading's time."""

    at: float
    prompt: int
    cached: int
    generated: int
    # The largest counter value behind it (for the rounding bound of llama-server's
    # six significant digits).
    magnitude: int = 0


@dataclass(slots=True)
class Tally:
    """Tokens on one side of a comparison."""

    prompt: int = 0
    completion: int = 0
    cached: int | None = None
    requests: int | None = None


class History:
    """One replica's readings as running totals (see the module's docstring)."""

    def __init__(self, model: str):
        self.model = model
        self.last: Reading | None = None
        self.fine: deque[Point] = deque()
        self.coarse: deque[Point] = deque()

    def add(self, r: Reading) -> None:
        last = self.last
        if last is not None and r.at <= last.at:
            return  # the same reading again (two heartbeats between two reads)
        self.last = r
        magnitude = max(r.prompt, r.generated)
        if last is None:
            self.fine.append(Point(r.at, 0, 0, 0, magnitude))
            return
        restarted = (
            r.process != last.process
            or r.prompt < last.prompt
            or r.generated < last.generated
            or (r.cached or 0) < (last.cached or 0)
        )
        base = Reading(r.at, 0, 0, 0, r.process) if restarted else last
        prev = self.fine[-1] if self.fine else self.coarse[-1]
        self.fine.append(
            Point(
                r.at,
                prev.prompt + r.prompt - base.prompt,
                prev.cached + (r.cached or 0) - (base.cached or 0),
                prev.generated + r.generated - base.generated,
                magnitude,
            )
        )

    def trim(self, now: float) -> None:
        """Thin readings older than FINE_S to one a minute; drop those past KEEP_S."""
        while len(self.fine) > 1 and self.fine[0].at < now - FINE_S:
            p = self.fine.popleft()
            if not self.coarse or p.at - self.coarse[-1].at >= COARSE_S:
                self.coarse.append(p)
        while self.coarse and self.coarse[0].at < now - KEEP_S:
            self.coarse.popleft()

    def points(self) -> list[Point]:
        return [*self.coarse, *self.fine]

    def newest(self) -> float:
        return self.fine[-1].at if self.fine else float("-inf")


def window(points: list[Point], since: float, until: float) -> tuple[Point, Point] | None:
    """The readings that bound (since, until] as closely as there are readings: the last
    at or before `since` (the first one, if none is that old) and the last at or before
    `until`. None when they are not two."""
    if not points:
        return None
    times = [p.at for p in points]
    i = bisect.bisect_right(times, since) - 1
    j = bisect.bisect_right(times, until) - 1
    i = max(i, 0)
    if j <= i:
        return None
    return points[i], points[j]


def engine_tally(start: Point, end: Point) -> Tally:
    return Tally(
        end.prompt - start.prompt, end.generated - start.generated, end.cached - start.cached
    )


def rounding(start: Point, end: Point) -> int:
    """How far the engine's side may be off for llama-server's six significant digits:
    half a unit of the sixth digit of each of the two readings, at the larger counter."""
    bound = 0.0
    for p in (start, end):
        if p.magnitude >= 1_000_000:
            bound += 0.5 * 10 ** (math.floor(math.log10(p.magnitude)) - 5)
    return math.ceil(bound)


def ratio(router: int, engine: int) -> float | None:
    """(router − engine) / engine: below 0, engines did work the rows do not bill."""
    if engine == 0:
        return None if router == 0 else math.inf
    return (router - engine) / engine


def compare(replica: str, model: str, start: Point, end: Point, router: Tally) -> dict:
    """One replica's line of the comparison, as the admin API answers it."""
    engine = engine_tally(start, end)
    mine = {"prompt": router.prompt, "completion": router.completion}
    theirs = {"prompt": engine.prompt, "completion": engine.completion}
    return {
        "replica": replica,
        "model": model,
        "from": start.at,
        "to": end.at,
        "router": {**mine, "cached": router.cached, "requests": router.requests},
        "engine": {**theirs, "cached": engine.cached},
        "difference": {k: mine[k] - theirs[k] for k in KINDS},
        "ratio": {k: _finite(ratio(mine[k], theirs[k])) for k in KINDS},
        "rounding": rounding(start, end),
    }


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else round(x, 6)


class EngineCounters:
    """Every replica's history, fed from heartbeats (on the scheduler's loop, under its
    lock)."""

    def __init__(self):
        self.replicas: dict[str, History] = {}

    def record(self, replica: str, model: str, tokens) -> None:
        r = Reading.of(tokens) if isinstance(tokens, dict) else None
        if r is None:
            return
        h = self.replicas.get(replica)
        if h is None:
            h = self.replicas[replica] = History(model)
        h.add(r)

    def trim(self, now: float) -> None:
        for rid in list(self.replicas):
            h = self.replicas[rid]
            h.trim(now)
            if h.newest() < now - KEEP_S:
                del self.replicas[rid]

    def snapshot(self) -> dict[str, tuple[str, list[Point]]]:
        """Each replica's model and points, copied (to be read without the lock)."""
        return {rid: (h.model, h.points()) for rid, h in self.replicas.items()}
