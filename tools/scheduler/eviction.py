"""Room for a wanted on-demand model that fits nowhere: the least recently used other
on-demand model whose replicas free enough on some node stops counting as active, the
next pass stops it, and the wanted one is placed once the agents report the memory free."""

import dataclasses

from llmgw import log
from llmgw.placement import place
from llmgw.states import LIVE
from llmgw_scheduler.demand import Demand
from llmgw_scheduler.inventory import Inventory
from llmgw_scheduler.models import Catalog
from llmgw_scheduler.needs import Needs

_log = log.get("llmgw.scheduler")

# After an eviction's victim is gone, how long its room may take to show in the agents'
# reports before the model it was evicted for is unplaceable again.
ROOM_GRACE_S = 10.0


class Eviction:
    def __init__(self, catalog: Catalog, inv: Inventory, needs: Needs, demand: Demand,
                 node_views, making_room: dict, flags):  # fmt: skip
        self.catalog = catalog
        self.inv = inv
        self.needs = needs
        self.demand = demand
        self.node_views = node_views  # () -> [NodeView], as placement sees the fleet now
        self.flags = flags
        # model -> (the model evicted for it, until when room is still coming)
        self.making_room = making_room

    def evict_for(self, unplaceable: dict, now: float) -> None:
        models, demand = self.catalog.models, self.demand
        for name in unplaceable:
            wanted = models.get(name)
            if wanted is None or wanted.min > 0 or not demand.active(wanted, now):
                continue
            need = self.needs.need(wanted)
            others = sorted(
                (m for m in models.values()
                 if m.min == 0 and m.name != name and demand.active(m, now)),
                key=lambda m: demand.last_active.get(m.name, 0.0),
            )  # fmt: skip
            lost = self.inv.lost_nodes()
            for victim in others:
                freed: dict[str, int] = {}
                for r in self.inv.of_model(victim.name):
                    if r.state in LIVE and r.node not in lost:
                        freed[r.node] = freed.get(r.node, 0) + self.needs.need(victim).memory
                if not freed:
                    continue
                views = [
                    dataclasses.replace(v, memory_free=v.memory_free + freed.get(v.id, 0))
                    for v in self.node_views()
                ]
                if place(need, views).node is not None:
                    idle = now - demand.last_active.get(victim.name, now)
                    _log.info("model_evicted", model=victim.name, for_model=name,
                              idle_s=round(idle, 1))  # fmt: skip
                    demand.evicted(victim.name, now)
                    self.making_room[name] = (victim.name, now + ROOM_GRACE_S)
                    self.flags.wake = True
                    break

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
