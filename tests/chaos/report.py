"""What a chaos run saw, phase by phase, as a table for people (Markdown)."""

from dataclasses import dataclass, field

import pytest

# The tables a session's chaos tests made, printed in pytest's terminal summary.
TABLES = pytest.StashKey[list]()


@dataclass
class Phase:
    """One kill and the traffic around it."""

    killed: str  # what, in words: "engine of node-a (pid 123)"
    sent: int = 0
    answered: int = 0  # complete 200 answers
    cut: int = 0  # streams broken after their first token
    failed: int = 0  # everything else that was not answered
    failed_over: int = 0  # answered by the second router after a connection error
    started: int = 0  # replica starts the schedulers logged during the phase
    recovered_s: float | None = None  # the kill to the invariant holding again
    slowest_s: float = 0.0  # the longest a complete answer took
    rows: int = 0  # usage rows with status 200 for the phase's requests
    missing: int = 0  # complete answers without a 200 row
    twice: int = 0  # complete answers with more than one 200 row
    unseen: int = 0  # 200 rows for requests the client did not see complete
    failures: list[str] = field(default_factory=list)


COLUMNS = (
    "killed", "sent", "answered", "cut streams", "failed", "failed over",
    "replicas started", "recovered (s)", "slowest answer (s)", "usage rows (200)", "missing",
    "twice", "unseen",
)  # fmt: skip


def table(phases: list[Phase]) -> str:
    def cells(p: Phase):
        rec = "" if p.recovered_s is None else f"{p.recovered_s:.1f}"
        return (p.killed, p.sent, p.answered, p.cut, p.failed, p.failed_over, p.started,
                rec, f"{p.slowest_s:.2f}", p.rows, p.missing, p.twice, p.unseen)  # fmt: skip

    rows = [COLUMNS, *(tuple(str(c) for c in cells(p)) for p in phases)]
    total = Phase("total")
    for p in phases:
        for f in ("sent", "answered", "cut", "failed", "failed_over", "started", "rows",
                  "missing", "twice", "unseen"):  # fmt: skip
            setattr(total, f, getattr(total, f) + getattr(p, f))
        total.slowest_s = max(total.slowest_s, p.slowest_s)
    rows.append(tuple(str(c) for c in cells(total)))
    return markdown(rows)


def markdown(rows: list[tuple[str, ...]]) -> str:
    """A Markdown table: the first row is the heading, the first column text, the rest
    numbers (right-aligned)."""
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join(["---"] + ["--:"] * (len(rows[0]) - 1)) + "|")
    return "\n".join(lines)
