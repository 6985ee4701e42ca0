"""What to start and stop so every model has between `min` and `max` replicas.

Pure: the desired models, the replicas and nodes as last reported, the backoff per model
and the time go in; decisions come out. The caller sends the commands and, when a
replica fails, records it with `after_failure`, so a model that cannot start is retried
less and less often rather than in a tight loop.

Rules of one pass:
- A replica counts while it is pending, starting or ready on a known node that is not
  lost. One on a lost or unknown node does not, so it is replaced elsewhere; if the node
  comes back, the surplus is stopped like any other.
- Below `min`, and not backing off: at most one start per model per pass, so a model that
  fails at once costs one replica, not `min`. Models with no replica at all go first.
- A model with several profiles (`Desired.needs`) is given the first, in order, that
  fits some node (placement.first_fit); `Decisions.profiles` says which.
- A start on a node without the engine says so (install first). While the engine is
  installing on the chosen node, nothing is returned for the model: the caller starts it
  once the install is done.
- Above `max`: stop the replicas that are not serving yet, then those on draining nodes,
  then the newest ready ones (the oldest have warm caches and proven health).
- Replicas of a model no longer desired are stopped.
"""

import random
from dataclasses import dataclass, field

from llmgw.placement import INSTALLING, Fleet, Need, NodeView, collector_paused, first_fit
from llmgw.states import ACTIVE, ShardState

PENDING, STARTING, READY = ShardState.PENDING, ShardState.STARTING, ShardState.READY
DRAINING, FAILED, STOPPED = ShardState.DRAINING, ShardState.FAILED, ShardState.STOPPED


@dataclass(frozen=True)
class Desired:
    model: str
    min: int
    max: int
    need: Need  # its first profile's
    # Every profile's need, in the order they are tried (empty: `need` alone).
    needs: tuple[Need, ...] = ()

    def tried(self) -> tuple[Need, ...]:
        return self.needs or (self.need,)


@dataclass(frozen=True)
class ReplicaView:
    id: str
    model: str
    node: str
    state: str  # pending | starting | ready | draining | failed | stopped
    since: float


@dataclass
class Backoff:
    failures: int = 0
    next_at: float = 0.0


def after_failure(b: Backoff, now: float, rng: random.Random, base: float, cap: float) -> Backoff:
    """One more failure: wait base × 2^(failures so far), at most cap, times 0.5-1.0.

    The jitter keeps a fleet of failing models (say, after a bad engine release) from
    retrying in lockstep and loading the nodes in waves.
    """
    delay = min(cap, base * 2 ** min(b.failures, 62))
    return Backoff(b.failures + 1, now + delay * rng.uniform(0.5, 1.0))


def after_success(b: Backoff) -> Backoff:
    return Backoff()


@dataclass
class Decisions:
    starts: list[tuple[str, str, bool]] = field(default_factory=list)  # model, node, install
    stops: list[str] = field(default_factory=list)  # replica ids
    unplaceable: dict[str, dict[str, str]] = field(default_factory=dict)  # model -> node -> why
    # model -> the profile its start runs ("" or absent: its only one)
    profiles: dict[str, str] = field(default_factory=dict)


def _stop_order(r: ReplicaView, draining_nodes: set[str]) -> tuple:
    if r.state != READY:
        group = 0 if r.state == PENDING else 1
    elif r.node in draining_nodes:
        group = 2
    else:
        group = 3
    return (group, -r.since, r.id)


@collector_paused()
def reconcile(desired: list[Desired], replicas: list[ReplicaView], nodes: list[NodeView],
              backoff: dict[str, Backoff], now: float) -> Decisions:  # fmt: skip
    out = Decisions()
    alive = {n.id: n for n in nodes if not n.lost}
    draining_nodes = {n.id for n in nodes if n.draining and not n.lost}
    wanted = {d.model for d in desired}

    counted: dict[str, list[ReplicaView]] = {}
    per_node: dict[str, dict[str, int]] = {}  # model -> node -> replicas, for spread
    for r in replicas:
        if r.state not in ACTIVE or r.node not in alive:
            continue
        if r.model not in wanted:
            out.stops.append(r.id)
            continue
        counted.setdefault(r.model, []).append(r)
        nodes_of = per_node.setdefault(r.model, {})
        nodes_of[r.node] = nodes_of.get(r.node, 0) + 1

    short: list[tuple[int, int, Desired]] = []
    for i, d in enumerate(desired):
        have = counted.get(d.model, ())
        if len(have) > d.max:
            extra = sorted(have, key=lambda r: _stop_order(r, draining_nodes))
            out.stops.extend(r.id for r in extra[: len(have) - d.max])
        elif len(have) < d.min:
            b = backoff.get(d.model)
            if b is None or b.next_at <= now:
                short.append((len(have), i, d))
    if not short:
        return out

    short.sort(key=lambda t: (t[0] > 0, t[1]))
    fleet = Fleet(nodes, replicas=per_node)
    for _, _, d in short:
        need, p = first_fit(fleet, d.tried())
        if p.node is None:
            out.unplaceable[d.model] = p.reasons
            continue
        if alive[p.node].engines.get(need.engine) == INSTALLING:
            continue
        out.starts.append((d.model, p.node, p.install))
        if need.profile:
            out.profiles[d.model] = need.profile
        fleet.take(need, p.node)
    return out
