"""What a partition scenario saw, checked against the invariants, as a table for people.

The numbers come from what the clients saw (tests/chaos/traffic.py), the usage rows in
the store, every process's log, and a thread that asks both schedulers who leads.
"""

import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from tests.chaos.report import markdown
from tests.chaos.traffic import CUT, FAILED, OK, Sent

# The tables a session's partition tests made, printed in pytest's terminal summary.
TABLES = pytest.StashKey[list]()

SCHEDULER_STARTS = re.compile(r": start_replica replica=(\S+)")
AGENT_STARTS = re.compile(r": shard_process_started shard=(\S+)")
ACCEPTED = re.compile(r": command_accepted type=(\S+) epoch=(\d+)")
# A scheduler's log, each line stamped by tests/partition/stamp.py: when it took the
# lease, and when it stopped acting (stepped_down says how long before it said so).
STAMPED = re.compile(r"^(\d+\.\d+) ", re.M)
LEADING = re.compile(r"^(\d+\.\d+) \S+ llmgw-scheduler: leading name=\S+ epoch=(\d+)", re.M)
STOPPED = re.compile(
    r"^(\d+\.\d+) \S+ llmgw-scheduler: (?:stepped_down|lease_released) epoch=(\d+)"
    r"(?:.* stopped_s_ago=([\d.]+))?",
    re.M,
)


def leading_intervals(log: str) -> list[tuple[int, float, float]]:
    """(epoch, from, to) for each time one scheduler process led, by its stamped log: from
    `leading` to `stepped_down` (less its stopped_s_ago: when it actually stopped acting)
    or `lease_released`; one still leading when its log ends leads to its last line."""
    starts = {int(e): float(t) for t, e in LEADING.findall(log)}
    ends: dict[int, float] = {}
    for t, e, ago in STOPPED.findall(log):
        ends.setdefault(int(e), float(t) - float(ago or 0))
    stamps = STAMPED.findall(log)
    last = float(stamps[-1]) if stamps else 0.0
    return sorted((e, t, ends.get(e, last)) for e, t in starts.items())


def overlapping(intervals: dict[str, list[tuple[int, float, float]]]) -> list[str]:
    """Every pair of intervals of two schedulers that overlap in time, said."""
    flat = sorted((t0, t1, e, who) for who, ivs in intervals.items() for e, t0, t1 in ivs)
    out = []
    for i, (_, t1, e, who) in enumerate(flat):
        for u0, _, f, other in flat[i + 1 :]:
            if u0 < t1 and other != who:
                out.append(f"{who} (epoch {e}) led until {t1:.3f}, {other} (epoch {f})"
                           f" from {u0:.3f}")  # fmt: skip
    return out


@dataclass
class Result:
    """One scenario: its fault, what the clients saw, and each invariant's count."""

    fault: str
    sent: int = 0
    answered: int = 0  # complete 200 answers
    cut: int = 0  # streams broken after their first token (the one allowed failure)
    failed: int = 0  # everything else not answered
    rows: int = 0  # usage rows with status 200 for the scenario's requests
    missing: int = 0  # complete answers without a 200 row
    twice: int = 0  # complete answers with more than one 200 row
    started_twice: int = 0  # replica ids started more than once
    leaders: int = 0  # the most schedulers that led at one moment (asked, or by logs)
    stale: int = 0  # commands agents accepted with an epoch older than one they had
    converged_s: float | None = None  # healing to the invariant holding again
    broken: list[str] = field(default_factory=list)  # invariants that did not hold

    def clients(self, sent: list[Sent], rows200: list[str]) -> None:
        """Count what the clients saw and match it to the usage rows (request ids)."""
        self.sent = len(sent)
        self.answered = sum(s.outcome == OK for s in sent)
        self.cut = sum(s.outcome == CUT for s in sent)
        self.failed = sum(s.outcome == FAILED for s in sent)
        per_rid = Counter(rows200)
        ok = {s.rid for s in sent if s.outcome == OK}
        mine = {s.rid for s in sent}
        self.rows = sum(n for rid, n in per_rid.items() if rid in mine)
        self.missing = sum(1 for rid in ok if rid not in per_rid)
        self.twice = sum(1 for rid in ok if per_rid[rid] > 1)
        if self.failed:
            fails = [f"{s.rid}: {s.detail}" for s in sent if s.outcome == FAILED]
            self.broken.append(f"{self.failed} requests not answered, e.g. {fails[:3]}")
        if self.missing or self.twice:
            self.broken.append(f"usage rows: missing {self.missing}, twice {self.twice}")

    def starts(self, scheduler_logs: str, agent_logs: str) -> None:
        """Replica ids started twice, by any scheduler or by any agent."""
        ids = SCHEDULER_STARTS.findall(scheduler_logs)
        spawned = AGENT_STARTS.findall(agent_logs)
        twice = {i for i, n in Counter(ids).items() if n > 1}
        twice |= {i for i, n in Counter(spawned).items() if n > 1}
        self.started_twice = len(twice)
        if twice:
            self.broken.append(f"replicas started twice: {sorted(twice)}")

    def epochs(self, agent_logs: dict[str, str]) -> None:
        """Commands an agent accepted after it had accepted one of a newer epoch."""
        for node, text in agent_logs.items():
            newest = 0
            for kind, epoch in ACCEPTED.findall(text):
                if int(epoch) < newest:
                    self.stale += 1
                    self.broken.append(f"{node} accepted {kind} of epoch {epoch} after {newest}")
                newest = max(newest, int(epoch))

    def watched(self, watch: "LeaderWatch") -> None:
        self.leaders = max(self.leaders, watch.most)
        if watch.most > 1:
            self.broken.append(f"{watch.most} schedulers led at once: {watch.overlaps[:3]}")

    def led(self, logs: dict[str, list[str]]) -> None:
        """Leading intervals by the schedulers' own stamped logs (each process's log
        apart): none of two schedulers may overlap."""
        intervals = {}
        for who, texts in logs.items():
            intervals[who] = [iv for text in texts for iv in leading_intervals(text)]
        both = overlapping(intervals)
        if both:
            self.leaders = max(self.leaders, 2)
            self.broken.append(f"leading intervals overlap by the logs: {both[:3]}")
        elif any(intervals.values()):
            self.leaders = max(self.leaders, 1)


COLUMNS = ("fault", "sent", "answered", "cut streams", "failed", "usage rows (200)", "missing",
           "twice", "replicas started twice", "leaders at once", "stale-epoch commands",
           "converged after healing (s)")  # fmt: skip


def table(results: list[Result]) -> str:
    def cells(r: Result):
        conv = "" if r.converged_s is None else f"{r.converged_s:.1f}"
        return (r.fault, r.sent, r.answered, r.cut, r.failed, r.rows, r.missing, r.twice,
                r.started_twice, r.leaders, r.stale, conv)  # fmt: skip

    return markdown([COLUMNS, *(tuple(str(c) for c in cells(r)) for r in results)])


class LeaderWatch:
    """Asks every scheduler its role every `every_s` on a thread, all at once, and keeps
    the most that said `leader` in one round (a hung one counts as not leading: it
    cannot act).

    Two answers are not one moment. Asked one after the other, a leader's `leader` and,
    a second later, its successor's would look like two at once when they were not; so
    the schedulers are asked in parallel, and two `leader`s count as an overlap only if
    every answer of the round came within `margin_s` — lease_s - step_down_s, the least
    time between one leader's last act and the next one's first, so answers that close
    cannot both be true unless two did lead at once. A round slower than that is
    counted in `unsure`, not as an overlap. Overlaps shorter than a round are missed:
    the schedulers' logs (Result.led) are the stronger check."""

    def __init__(self, role, schedulers: list[str], every_s: float = 0.1,
                 margin_s: float = 1.0):  # fmt: skip
        self.role, self.schedulers, self.every_s = role, schedulers, every_s
        self.margin_s = margin_s
        self.most = 0
        self.unsure = 0
        self.overlaps: list[list[str]] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max(1, len(schedulers)))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _ask(self, name: str) -> tuple[str, float, float]:
        t0 = time.monotonic()
        role = self.role(name)
        return role, t0, time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            answers = dict(zip(self.schedulers, self._pool.map(self._ask, self.schedulers),
                               strict=True))  # fmt: skip
            self.count(answers)

    def count(self, answers: dict[str, tuple[str, float, float]]) -> None:
        """One round: name -> (role, asked at, answered at)."""
        leading = [s for s, (role, _, _) in answers.items() if role == "leader"]
        if len(leading) > 1:
            span = max(answers[s][2] for s in leading) - min(answers[s][1] for s in leading)
            if span >= self.margin_s:
                self.unsure += 1
                return
            self.overlaps.append(leading)
        self.most = max(self.most, len(leading))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pool.shutdown(wait=False)
