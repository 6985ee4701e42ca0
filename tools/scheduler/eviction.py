"""Room for a wanted on-demand model that fits nowhere: another on-demand model whose
replicas free enough on some node stops counting as active, the next pass stops it, and
the wanted one is placed once the agents report the memory free.

Of the models that would free enough, the one cheapest to bring back goes: its measured
cold start (coldstarts.py) times its recent demand (Demand.rate), ties by least recently
used. A model whose replicas became ready less than `scheduler.eviction_min_lifetime_s`
ago (or are still starting) is never evicted: two on-demand models that cannot both fit
would otherwise evict each other on every request, and neither would serve. While only
such a model could make room, the wanted one stays unplaceable and says why (`held`).
"""

import dataclasses
import math

from llmgw import log
from llmgw.placement import place
from llmgw.states import LIVE, STARTING
from llmgw_scheduler.coldstarts import ColdStarts
from llmgw_scheduler.demand import Demand
from llmgw_scheduler.inventory import Inventory
from llmgw_scheduler.models import Catalog
from llmgw_scheduler.needs import Needs

_log = log.get("llmgw.scheduler")

# After an eviction's victim is gone, how long its room may take to show in the agents'
# reports before the model it was evicted for is unplaceable again.
ROOM_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A model whose replicas would free enough for the wanted one."""

    name: str
    cost: float  # cold-start seconds x uses per minute: what evicting it costs its users
    last_active: float
    held_until: float  # it may not be evicted before then (inf: still starting)


def held_until(replicas, min_lifetime_s: float) -> float:
    """When the last of a model's `replicas` has been ready `min_lifetime_s`; inf while
    one is still starting (it has not served yet); -inf with no minimum."""
    if min_lifetime_s <= 0:
        return -math.inf
    until = -math.inf
    for r in replicas:
        if r.state in STARTING or not r.ready_at:
            return math.inf
        until = max(until, r.ready_at + min_lifetime_s)
    return until


def choose(candidates: list[Candidate], now: float) -> tuple[Candidate | None, Candidate | None]:
    """(the victim, None): the cheapest to bring back of those past their minimum
    lifetime, the least recently used of equals; or (None, the one that may go soonest)
    when every candidate is held; (None, None) with none."""
    free = [c for c in candidates if c.held_until <= now]
    if free:
        return min(free, key=lambda c: (c.cost, c.last_active, c.name)), None
    if candidates:
        return None, min(candidates, key=lambda c: (c.held_until, c.cost, c.name))
    return None, None


class Eviction:
    def __init__(self, catalog: Catalog, inv: Inventory, needs: Needs, demand: Demand,
                 node_views, making_room: dict, flags, cfg,
                 coldstarts: ColdStarts):  # fmt: skip
        self.catalog = catalog
        self.inv = inv
        self.needs = needs
        self.demand = demand
        self.node_views = node_views  # () -> [NodeView], as placement sees the fleet now
        self.flags = flags
        self.cfg = cfg  # the scheduler section: eviction_min_lifetime_s
        self.coldstarts = coldstarts
        # model -> (the model evicted for it, until when room is still coming)
        self.making_room = making_room
        # model -> (the model that would make room, when it may): as the last pass found
        self.held: dict[str, tuple[str, float]] = {}
        self.evictions: dict[str, int] = {}  # model -> times evicted (a metric)

    def evict_for(self, unplaceable: dict, now: float) -> None:
        models, demand = self.catalog.models, self.demand
        held: dict[str, tuple[str, float]] = {}
        for name in unplaceable:
            wanted = models.get(name)
            if wanted is None or wanted.min > 0 or not demand.active(wanted, now):
                continue
            if name in self.making_room:
                continue  # a victim is on its way out for it: its room is coming
            victim, holder = choose(self.candidates(name, now), now)
            if holder is not None:
                held[name] = (holder.name, holder.held_until)
                if self.held.get(name, ("",))[0] != holder.name:
                    _log.info("eviction_held", model=holder.name, for_model=name,
                              wait_s=_wait(holder.held_until, now))  # fmt: skip
            if victim is None:
                continue
            idle = now - demand.last_active.get(victim.name, now)
            _log.info("model_evicted", model=victim.name, for_model=name,
                      idle_s=round(idle, 1), cost=round(victim.cost, 1))  # fmt: skip
            demand.evicted(victim.name, now)
            self.evictions[victim.name] = self.evictions.get(victim.name, 0) + 1
            self.making_room[name] = (victim.name, now + ROOM_GRACE_S)
            self.flags.wake = True
        self.held = held

    def candidates(self, name: str, now: float) -> list[Candidate]:
        """The other active on-demand models whose replicas would free enough on some
        node for `name`."""
        models, demand = self.catalog.models, self.demand
        needs = self.needs.options(models[name])  # room for any of its profiles will do
        lost = self.inv.lost_nodes()
        views = None
        out = []
        for m in models.values():
            if m.min != 0 or m.name == name or not demand.active(m, now):
                continue
            live = [r for r in self.inv.of_model(m.name) if r.state in LIVE and r.node not in lost]
            freed: dict[str, int] = {}
            for r in live:
                held = self.needs.need(self.catalog.of_replica(r) or m).memory
                freed[r.node] = freed.get(r.node, 0) + held
            if not freed:
                continue
            views = views if views is not None else self.node_views()
            room = [dataclasses.replace(v, memory_free=v.memory_free + freed.get(v.id, 0))
                    for v in views]  # fmt: skip
            if all(place(need, room).node is None for need in needs):
                continue
            cost = self.coldstarts.of(m.name) * demand.rate(m.name, now)
            out.append(Candidate(m.name, cost, demand.last_active.get(m.name, 0.0),
                                 held_until(live, self.cfg.eviction_min_lifetime_s)))  # fmt: skip
        return out

    def why_held(self, model: str, now: float) -> str:
        """Why eviction makes no room for `model` yet ("" when nothing holds it)."""
        if model not in self.held:
            return ""
        holder, until = self.held[model]
        least = self.cfg.eviction_min_lifetime_s
        if until == math.inf:
            when = f"until it has been ready {least:g} s (scheduler.eviction_min_lifetime_s)"
        else:
            when = (f"for another {_wait(until, now)} s"
                    f" (scheduler.eviction_min_lifetime_s = {least:g})")  # fmt: skip
        return f"no room: {holder} holds it and may not be evicted {when}"

    def room_coming(self, unplaceable: dict, now: float) -> None:
        """Keep a model whose eviction is under way `starting`, not `unplaceable`, until
        its victim's replicas are gone and the agents have reported the memory free."""
        for name, (victim, until) in list(self.making_room.items()):
            if name not in unplaceable:
                del self.making_room[name]  # placed, or no longer wanted
            elif self.inv.of_model(victim):
                self.making_room[name] = (victim, now + ROOM_GRACE_S)
            elif now >= until:
                del self.making_room[name]


def _wait(until: float, now: float) -> int | None:
    """Whole seconds until `until` (None: not known yet, still starting)."""
    return None if until == math.inf else max(1, math.ceil(until - now))
