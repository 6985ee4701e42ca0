"""Each model's recent history, for the status page: its state over time (serving,
starting, backoff, parked, unplaceable, stopped), and the events between — scaled,
a start failed, parked, restarted.

The scheduler observes every model after each pass as leader; a mark is kept only when
something changed, so a quiet model costs nothing and a flapping one at most
`per_model` marks (the oldest go first). Marks live in memory: a restarted scheduler,
or a standby that takes over, begins a new history (the log has the old one).
"""

from collections import deque
from dataclasses import dataclass

KEEP_S = 86400.0
PER_MODEL = 500
# States whose reason is worth saying in the event.
BAD = ("parked", "unplaceable", "backoff")


@dataclass(frozen=True, slots=True)
class Look:
    """What a pass saw of one model."""

    state: str
    desired: int
    ready: int
    failures: int = 0  # failed starts in a row
    restarting: int = 0  # its replicas queued or being restarted (`llmgw restart`)
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Mark:
    """A change: the model as it was from `at` on, and what happened."""

    at: float
    look: Look
    events: tuple[str, ...]


def changes(before: Look | None, now: Look) -> tuple[str, ...]:
    """The events between two looks at a model, as people say them; () when nothing
    worth a mark changed (a new reason alone is not a change of state)."""
    if before is None:
        return (f"first seen {now.state}",)
    out = []
    if now.state != before.state:
        why = f": {now.reason.splitlines()[-1][:120]}" if now.reason.strip() else ""
        out.append(f"{before.state} → {now.state}{why if now.state in BAD else ''}")
    if now.desired != before.desired:
        out.append(f"scaled {before.desired} → {now.desired}")
    if now.failures > before.failures:
        out.append(f"start failed ({now.failures} in a row)")
    if now.restarting > before.restarting:
        out.append(f"restart of {now.restarting} replica(s) queued")
    elif now.restarting == 0 and before.restarting:
        out.append("restart finished")
    if now.ready != before.ready:
        out.append(f"ready {before.ready} → {now.ready}")
    return tuple(out)


# What each kind of event counts as in the history's totals.
KINDS = {"scaled": "scalings", "start failed": "failed starts", "restart of": "restarts",
         "→ parked": "parks"}  # fmt: skip


class History:
    def __init__(self, keep_s: float = KEEP_S, per_model: int = PER_MODEL):
        self.keep_s = keep_s
        self.per_model = per_model
        self.marks: dict[str, deque[Mark]] = {}

    def observe(self, model: str, look: Look, now: float) -> None:
        marks = self.marks.setdefault(model, deque(maxlen=self.per_model))
        events = changes(marks[-1].look if marks else None, look)
        if events:
            marks.append(Mark(now, look, events))
        # The mark in force at the window's start stays: it says what the state was.
        while len(marks) > 1 and marks[1].at < now - self.keep_s:
            marks.popleft()

    def forget_others(self, models: set[str]) -> None:
        """Models no longer in the catalog have no history to show."""
        for gone in [m for m in self.marks if m not in models]:
            del self.marks[gone]

    def spans(self, model: str, x0: float, x1: float) -> list[tuple[float, float, str]]:
        """(start, end, state) over x0..x1: each mark's state until the next mark."""
        return [(start, end, look.state) for start, end, look in self._looks(model, x0, x1)]

    def steps(self, model: str, what: str, x0: float, x1: float) -> list[tuple[float, float]]:
        """`what` ("ready" or "desired") as a step line over x0..x1: a point where each
        value begins and one where it ends."""
        out = []
        for start, end, look in self._looks(model, x0, x1):
            v = float(getattr(look, what))
            out += [(start, v), (end, v)]
        return out

    def _looks(self, model: str, x0: float, x1: float):
        marks = list(self.marks.get(model, ()))
        for i, m in enumerate(marks):
            end = marks[i + 1].at if i + 1 < len(marks) else x1
            if end > x0 and m.at < x1:
                yield max(m.at, x0), min(end, x1), m.look

    def events(self, model: str, since: float) -> list[tuple[float, str]]:
        """(when, event) since `since`, oldest first."""
        return [(m.at, ev) for m in self.marks.get(model, ()) if m.at >= since for ev in m.events]

    def counts(self, model: str, since: float) -> dict[str, int]:
        """How many scalings, failed starts, restarts and parks since `since`."""
        out = dict.fromkeys(KINDS.values(), 0)
        for _, ev in self.events(model, since):
            for word, kind in KINDS.items():
                if word in ev:
                    out[kind] += 1
        return out
