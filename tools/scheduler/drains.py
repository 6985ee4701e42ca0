"""`llmgw nodes drain`: a draining node takes no new replicas, and each of its replicas is
stopped once its model keeps `min` ready replicas without it, or once the grace period
is over. Drains are kept in the store, so they outlive a restart."""

from llmgw import log
from llmgw.states import LIVE, ShardState
from llmgw.store import DrainedNode
from llmgw_scheduler.commands import Commands
from llmgw_scheduler.inventory import Inventory
from llmgw_scheduler.models import Catalog

_log = log.get("llmgw.scheduler")


class Drains:
    def __init__(self, inv: Inventory, catalog: Catalog, commands: Commands, cfg, flags):
        self.inv = inv
        self.catalog = catalog
        self.commands = commands
        self.cfg = cfg  # the scheduler section: drain_grace_s
        self.flags = flags
        self.drained: dict[str, float] = {}  # node -> draining since

    def __contains__(self, node: str) -> bool:
        return node in self.drained

    def load(self) -> None:
        for row in DrainedNode.select():
            self.drained[row.name] = row.since

    def reload(self) -> None:
        self.drained.clear()
        self.load()
        for node in self.inv.nodes.values():
            node.draining = node.id in self.drained

    def drain(self, node: str, now: float) -> None:
        DrainedNode.insert(name=node, since=now).on_conflict_ignore().execute()
        self.drained.setdefault(node, now)
        if node in self.inv.nodes:
            self.inv.nodes[node].draining = True
        self.flags.wake = self.flags.routes_dirty = True
        _log.info("node_draining", node=node, replicas=len(self.inv.on_node(node)))

    def undrain(self, node: str) -> None:
        DrainedNode.delete().where(DrainedNode.name == node).execute()
        self.drained.pop(node, None)
        if node in self.inv.nodes:
            self.inv.nodes[node].draining = False
        self.flags.wake = self.flags.routes_dirty = True
        _log.info("node_undrained", node=node)

    def pass_(self, now: float) -> None:
        """Stop the replicas on draining nodes that are no longer needed."""
        if not self.drained:
            return
        lost = self.inv.lost_nodes()
        ready: dict[str, int] = {}
        for r in self.inv.replicas.values():
            if r.state == ShardState.READY and r.node not in lost:
                ready[r.model] = ready.get(r.model, 0) + 1
        leaving = sorted(
            (r for node in self.drained for r in self.inv.on_node(node) if r.state in LIVE),
            key=lambda r: r.since,
        )
        for r in leaving:
            m = self.catalog.models.get(r.model)
            overdue = now - self.drained[r.node] >= self.cfg.drain_grace_s
            if r.state != ShardState.READY:
                self.commands.stop(r.id, now)  # not serving anyway
            elif m is None or overdue or ready.get(r.model, 0) - 1 >= m.min:
                ready[r.model] = ready.get(r.model, 0) - 1
                self.commands.stop(r.id, now)
