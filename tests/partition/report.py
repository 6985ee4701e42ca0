"""What a partition scenario saw, checked against the invariants, as a table for people.

The numbers come from what the clients saw (tests/chaos/traffic.py), the usage rows in
the store, every process's log, and a thread that asks both schedulers who leads.
"""

import re
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest

from tests.chaos.report import markdown
from tests.chaos.traffic import CUT, FAILED, OK, Sent

# The tables a session's partition tests made, printed in pytest's terminal summary.
TABLES = pytest.StashKey[list]()

SCHEDULER_STARTS = re.compile(r": start_replica replica=(\S+)")
AGENT_STARTS = re.compile(r": shard_process_started shard=(\S+)")
ACCEPTED = re.compile(r": command_accepted type=(\S+) epoch=(\d+)")


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
    leaders: int = 0  # the most schedulers that said they lead at one moment
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
        self.leaders = watch.most
        if watch.most > 1:
            self.broken.append(f"{watch.most} schedulers led at once: {watch.overlaps[:3]}")


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
    """Asks every scheduler its role every `every_s` on a thread, and keeps the most that
    said `leader` in one round (a hung one counts as not leading: it cannot act)."""

    def __init__(self, role, schedulers: list[str], every_s: float = 0.1):
        self.role, self.schedulers, self.every_s = role, schedulers, every_s
        self.most = 0
        self.overlaps: list[list[str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            leading = [s for s in self.schedulers if self.role(s) == "leader"]
            self.most = max(self.most, len(leading))
            if len(leading) > 1:
                self.overlaps.append(leading)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
