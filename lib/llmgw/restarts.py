"""Restarting replicas without an outage: what to start, stop and give up on each pass.

Pure: the queued restarts, the replicas and nodes as last reported, each model's need
and the time go in; steps come out, and the restarts' states are updated in place.

A restart of a replica goes one of two ways:
- surge (preferred): a replacement is started beside it; once the replacement is
  ready the old one is stopped. The old one serves until then.
- in place: where nothing fits beside it but would once it is gone (only the old
  replica is in the way), or when asked with `in_place`, the old one is stopped at
  once and the reconciler starts its successor as for any missing replica.
Where nothing would fit even without it, the restart is given up and the reason
said; the old replica keeps serving.

Replicas of one model are restarted one at a time unless `max_surge` (replacements
beside their old ones at once) or `max_unavailable` (old ones stopped before their
replacement is ready) allow more: at most max(max_surge, max_unavailable) in flight.
With `max_surge` 0 nothing is started beside: up to `max_unavailable` old replicas are
stopped first and their successors started in their place (it once waited forever on a
fleet with room beside them).

A queued restart that waits `deadline_s` without its model's restarts moving (one of
them beginning or ending) is given up, with the reason: nothing waits forever.
"""

import dataclasses
from dataclasses import dataclass, field

from llmgw.placement import Fleet, Need, NodeView, gpus_needed, place
from llmgw.reconciler import READY, ReplicaView
from llmgw.states import GONE

QUEUED, REPLACING, DONE, GIVEN_UP = "queued", "replacing", "done", "given up"
SURGE, IN_PLACE = "surge", "in place"
KEEP_ENDED = 50  # ended restarts kept to show, newest last


@dataclass
class Restart:
    replica: str
    model: str
    node: str
    queued_at: float
    max_surge: int = 1
    max_unavailable: int = 1
    in_place: bool = False
    state: str = QUEUED
    how: str = ""  # SURGE or IN_PLACE, once replacing
    replacement: str = ""  # the surge replacement's replica id
    ready_before: int = 0  # in place: the model's ready replicas when the old one stopped
    since: float = 0.0  # replacing since / ended at
    reason: str = ""  # why it was given up, or how it ended
    waiting_since: float = 0.0  # queued: since when its model's restarts last moved

    def __post_init__(self):
        self.waiting_since = self.waiting_since or self.queued_at

    @property
    def active(self) -> bool:
        return self.state in (QUEUED, REPLACING)


@dataclass
class Steps:
    surge: list[tuple[Restart, str]] = field(default_factory=list)  # start beside, on node
    stop_now: list[Restart] = field(default_factory=list)  # in place: stop the old one
    retire: list[Restart] = field(default_factory=list)  # replacement ready: stop the old
    ended: list[Restart] = field(default_factory=list)  # done or given up this pass


def _end(steps: Steps, r: Restart, state: str, reason: str, now: float) -> None:
    r.state, r.reason, r.since = state, reason, now
    steps.ended.append(r)


def plan(restarts: list[Restart], replicas: dict[str, ReplicaView], nodes: list[NodeView],
         needs: dict[str, Need], now: float, timeout_s: float,
         holds: dict[str, int] | None = None, deadline_s: float = 0.0,
         own: dict[str, Need] | None = None) -> Steps:  # fmt: skip
    """One pass over `restarts` (in queue order). The caller starts the surge
    replacements and sets `replacement` on each. `holds` is the memory each replica
    takes in the node views (default: its model's need). `deadline_s` (0: none) is how
    long a queued restart may wait without its model's restarts moving. `own`: replica
    id -> its need, for one that runs another of its model's profiles than `needs` has
    (its replacement runs the same)."""
    steps = Steps()
    moved = _Moved(now)
    ready: dict[str, int] = {}
    for v in replicas.values():
        if v.state == READY:
            ready[v.model] = ready.get(v.model, 0) + 1

    in_flight: dict[str, list[int]] = {}  # model -> [surge, in place]
    for r in restarts:
        if r.state != REPLACING:
            continue
        old, new = replicas.get(r.replica), replicas.get(r.replacement)
        if r.how == SURGE:
            if new is not None and new.state == READY:
                if old is not None and old.state not in GONE:
                    steps.retire.append(r)
                _end(steps, r, DONE, f"replaced by {r.replacement}", now)
            elif new is None or new.state in GONE:
                _end(steps, r, GIVEN_UP,
                     f"its replacement {r.replacement} failed to start; it keeps serving",
                     now)  # fmt: skip
            elif old is None:
                _end(steps, r, DONE, f"it went away; {r.replacement} is starting", now)
            elif now - r.since > timeout_s:
                _end(steps, r, GIVEN_UP,
                     f"its replacement was not ready within {timeout_s:g}s; it keeps serving",
                     now)  # fmt: skip
        else:
            if old is None and ready.get(r.model, 0) >= r.ready_before:
                _end(steps, r, DONE, "replaced in place", now)
            elif now - r.since > timeout_s:
                _end(
                    steps,
                    r,
                    GIVEN_UP,
                    f"stopped, but no successor was ready within {timeout_s:g}s",
                    now,
                )
        if r.state == REPLACING:
            in_flight.setdefault(r.model, [0, 0])[r.how == IN_PLACE] += 1
        else:
            moved.began(r.model)  # it ended

    fleet = Fleet(nodes)
    for r in restarts:
        if r.state != QUEUED:
            continue
        old = replicas.get(r.replica)
        if old is None or old.state in GONE:
            _end(steps, r, DONE, "it went away before its turn", now)
            continue
        moved.note(r)
        if deadline_s and now - r.waiting_since > deadline_s:
            _end(steps, r, GIVEN_UP,
                 f"it waited {deadline_s:g}s in the queue while its model's restarts did "
                 "not move (scheduler.restart_deadline_s); it keeps serving", now)  # fmt: skip
            continue
        flight = in_flight.setdefault(r.model, [0, 0])
        if sum(flight) >= max(r.max_surge, r.max_unavailable, 1):
            continue  # its model's earlier restarts go first
        need = (own or {}).get(r.replica) or needs.get(r.model)
        if need is None:
            _end(steps, r, GIVEN_UP, "its model is no longer in the catalog", now)
            continue
        if not r.in_place and r.max_surge > 0:
            p = fleet.place(need)
            if p.node is not None and not p.install:
                if flight[0] < r.max_surge:
                    fleet.take(need, p.node)
                    r.state, r.how, r.since = REPLACING, SURGE, now
                    steps.surge.append((r, p.node))
                    flight[0] += 1
                continue  # fits beside it: wait for a surge slot rather than go down
        if flight[1] >= r.max_unavailable:
            if r.max_unavailable == 0:
                _end(steps, r, GIVEN_UP,
                     "no room beside it, and --max-unavailable 0 forbids stopping it first",
                     now)  # fmt: skip
            continue
        k = gpus_needed(need)
        freed = 0 if k else (holds or {}).get(old.id, need.memory)
        p = place(need, _without(nodes, old, freed, k, need.memory))
        if p.node is None:
            why = "; ".join(f"{n}: {w}" for n, w in sorted(p.reasons.items())) or "no nodes"
            _end(steps, r, GIVEN_UP, f"nothing would fit even without it ({why})", now)
            continue
        r.state, r.how, r.since = REPLACING, IN_PLACE, now
        r.ready_before = ready.get(r.model, 0)
        steps.stop_now.append(r)
        flight[1] += 1
    for r, _ in steps.surge:
        moved.began(r.model)
    for r in steps.stop_now:
        moved.began(r.model)
    moved.apply()
    return steps


class _Moved:
    """Which models' restarts moved this pass (one began or ended): their queued ones
    start waiting afresh, for the deadline."""

    def __init__(self, now: float):
        self.now = now
        self.models: set[str] = set()
        self.queued: list[Restart] = []

    def note(self, r: Restart) -> None:
        self.queued.append(r)

    def began(self, model: str) -> None:
        self.models.add(model)

    def apply(self) -> None:
        for r in self.queued:
            if r.state == QUEUED and r.model in self.models:
                r.waiting_since = self.now


def _without(nodes: list[NodeView], old: ReplicaView, freed: int, gpus: int = 0,
             gpu_memory: int = 0) -> list[NodeView]:  # fmt: skip
    """The node views as they would be with `old` stopped: its host memory (`freed`), its
    GPUs and its place in the spread count back. The GPUs assigned to it are free again,
    each with `gpu_memory` more free (a GPU model on a full GPU node could otherwise never
    be restarted in place); for one whose GPUs are not known (started before agents said
    which), that much goes back to the fullest `gpus` of those not assigned."""
    out = []
    for n in nodes:
        if n.id == old.node:
            counts = dict(n.replicas)
            counts[old.model] = max(0, counts.get(old.model, 0) - 1)
            back = [dataclasses.replace(g, booked="", free=g.free + gpu_memory)
                    if g.booked == old.id else g for g in n.gpus]  # fmt: skip
            if not any(g.booked == old.id for g in n.gpus):
                fullest = sorted((i for i, g in enumerate(back) if not g.why_not),
                                 key=lambda i: back[i].free)[:gpus]  # fmt: skip
                for i in fullest:
                    back[i] = dataclasses.replace(back[i], free=back[i].free + gpu_memory)
            n = dataclasses.replace(n, memory_free=n.memory_free + freed, replicas=counts,
                                    gpus=tuple(back))  # fmt: skip
        out.append(n)
    return out
