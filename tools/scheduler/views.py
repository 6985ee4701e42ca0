"""What the scheduler's state looks like from outside: nodes as placement sees them,
each model's state and reason, and the routing table. Called under the lock on every
pass and publish, so each walks only the inventory's indexes, never all of it per item."""

from llmgw import apikeys, log
from llmgw.placement import Gpu, GpuPick, Need, NodeView, gpus_needed, pick_gpus
from llmgw.states import LIVE, ModelState, ShardState
from llmgw_scheduler.demand import Demand
from llmgw_scheduler.inventory import Inventory, Replica, accelerators
from llmgw_scheduler.models import Catalog
from llmgw_scheduler.needs import Needs
from llmgw_scheduler.parking import Parking

_log = log.get("llmgw.scheduler")


class Unplaceable(dict):
    """model -> why it fits nowhere, as the last pass found it."""

    def __init__(self, flags, clock):
        super().__init__()
        self.flags = flags
        self.clock = clock
        self._logged: dict[str, float] = {}

    def report(self, unplaceable: dict[str, dict[str, str]]) -> None:
        """Log when a model's reason changes, and every ten minutes while it lasts:
        never on every pass (250 identical lines in two days once buried everything)."""
        now = self.clock()
        for model, reasons in unplaceable.items():
            text = "; ".join(f"{n}: {why}" for n, why in sorted(reasons.items())) or "no nodes"
            changed = self.get(model) != text
            if changed or now - self._logged.get(model, 0) >= 600:
                _log.warning("no_placement", model=model, reasons=text[:500])
                self._logged[model] = now
            if changed:
                self.flags.routes_dirty = True
            self[model] = text
        for model in list(self):
            if model not in unplaceable:
                del self[model]
                self._logged.pop(model, None)
                self.flags.routes_dirty = True


class Views:
    adapters = None  # the Adapters (adapters.py): what each replica serves of them
    eviction = None  # the Eviction (eviction.py): what holds a wanted model's room

    def __init__(self, catalog: Catalog, inv: Inventory, needs: Needs, parking: Parking,
                 demand: Demand, unplaceable: Unplaceable, making_room: dict,
                 cluster_secret: str, clock):  # fmt: skip
        self.catalog = catalog
        self.inv = inv
        self.needs = needs
        self.parking = parking
        self.demand = demand
        self.unplaceable = unplaceable
        self.cluster_secret = cluster_secret
        self.clock = clock
        self.making_room = making_room  # the Eviction's: model -> (victim, until)

    def node_views(self) -> list[NodeView]:
        return [self.node_view(node) for node in self.inv.nodes.values()]

    def pick_gpus(self, need: Need, node_id: str) -> GpuPick | None:
        """The GPUs a replica of `need` would be assigned on `node_id` now (None: it needs
        none, or too few can be taken)."""
        node = self.inv.nodes.get(node_id)
        k = gpus_needed(need)
        if node is None or k == 0:
            return None
        view = self.node_view(node)
        return pick_gpus(view.gpus, k, need.memory, view.topology)

    def assign_gpus(self, m, node_id: str) -> tuple[str, ...] | None:
        """Commands.assign: the UUIDs a replica of `m` gets on `node_id` (() for a model
        that needs no GPUs; None if too few can be taken)."""
        need = self.needs.need(m)
        if gpus_needed(need) == 0:
            return ()
        pick = self.pick_gpus(need, node_id)
        return pick.uuids if pick is not None else None

    def node_view(self, node) -> NodeView:
        models = self.catalog.models
        # The node's reported free memory already lacks what its replicas use now.
        # Reserve what they are expected to use on top: all of it for one still
        # loading, the rest of it for one whose resident size is below the need
        # (llama.cpp maps weights in as pages are touched).
        reserved = 0
        counts: dict[str, int] = {}
        booked: dict[str, str] = {}  # GPU UUID -> the replica assigned it
        for r in self.inv.on_node(node.id):
            for uuid in r.gpus:  # until it is gone, whatever its state
                booked[uuid] = r.id
            if r.state in LIVE:
                counts[r.model] = counts.get(r.model, 0) + 1
                m = models.get(r.model)
                if m is not None and m.profiles:  # what its own profile needs
                    m = self.catalog.of_replica(r) or m
                if r.memory >= 0:  # a gang's leader: its workers hold the weights
                    reserved += max(0, r.memory - r.rss)
                elif m is not None:
                    reserved += max(0, self.needs.need(m).memory - r.rss)
        for w in self.inv.workers_on(node.id):  # its part of a replica across nodes
            if w.state in LIVE:
                reserved += max(0, w.memory - w.rss)
        engines = {}
        for eid, info in node.engines.items():
            state = info.get("state", "")
            engines[eid] = f"failed: {info.get('reason', '')}" if state == "failed" else state
        gpus = tuple(Gpu.from_report(g, booked) for g in node.gpus if isinstance(g, dict))
        return NodeView(
            id=node.id, lost=node.lost, draining=node.draining,
            memory_free=max(0, node.memory_available - reserved),
            gpus=gpus, engines=engines, replicas=counts,
            disk_free=node.disk_free, weights=node.weights, topology=node.matrix,
            accelerators=accelerators(node),
        )  # fmt: skip

    def status_of(self, model: str, lost: set[str] | None = None) -> tuple[str, str]:
        """A model's or an adapter's (state, reason)."""
        if model in self.catalog.adapters:
            return self.adapters.status(model, lambda base: self.model_status(base, lost))
        return self.model_status(model, lost)

    def model_status(self, model: str, lost: set[str] | None = None) -> tuple[str, str]:
        """(state, reason): serving, starting, backoff, parked, unplaceable or stopped."""
        parked = self.parking.parked.get(model)
        if parked is not None:
            return ModelState.PARKED, parked.reason
        if lost is None:
            lost = self.inv.lost_nodes()
        if self.inv.serving(model, lost):
            return ModelState.SERVING, ""
        if model in self.making_room:
            return (
                ModelState.STARTING,
                f"making room: {self.making_room[model][0]} is being stopped",
            )
        now = self.clock()
        if model in self.unplaceable:
            held = self.eviction.why_held(model, now) if self.eviction is not None else ""
            # Last: the routing table keeps a reason's last 500 characters.
            return ModelState.UNPLACEABLE, "; ".join(filter(None, (self.unplaceable[model], held)))
        b = self.parking.backoff.get(model)
        if b is not None and b.failures and b.next_at > now:
            return ModelState.BACKOFF, self.parking.last_error.get(model, "")
        m = self.catalog.models[model]
        if m.min == 0 and not self.demand.active(m, now):
            return ModelState.STOPPED, ""
        return ModelState.STARTING, ""

    def routes(self, seq: int) -> dict:
        """The routing table: ready replicas, keeping a lost node's replicas only while
        their model has no ready replica on a live node (its engines may well still run)."""
        lost = self.inv.lost_nodes()
        ready = [r for r in self.inv.replicas.values()
                 if r.state == ShardState.READY and r.endpoint]  # fmt: skip
        served_live = {r.model for r in ready if r.node not in lost}
        models = self.catalog.models
        out = []
        for r in ready:
            if r.node in lost and r.model in served_live:
                continue
            m = models.get(r.model)
            if not r.key:  # adopted: derived once, not on every publish
                r.key = apikeys.engine_key(self.cluster_secret, r.id)
            entry = {
                "id": r.id, "model": r.model, "aliases": list(m.aliases) if m else [],
                "endpoint": r.endpoint,
                "key": r.key,
                "state": ShardState.READY,
                "engine": m.engine if m else "",
            }  # fmt: skip
            if r.adapters and self.adapters is not None:
                adapters = self.catalog.adapters
                entry["adapters"] = [{"name": a, "aliases": list(adapters[a].aliases)}
                                     for a in self.adapters.serving(r)]  # fmt: skip
            out.append(entry)
        entries = []
        answered = self.demand.answered
        for m in [*models.values(), *self.catalog.adapters.values()]:
            state, reason = self.status_of(m.name, lost)
            entry = {"name": m.name, "aliases": list(m.aliases), "state": state,
                     "reason": reason[-500:]}  # fmt: skip
            if m.name in answered:
                entry["answered"] = dict(answered[m.name])  # router -> its want number
            entries.append(entry)
        return {"seq": seq, "replicas": out, "models": entries}

    @staticmethod
    def idle_s(r: Replica, now: float) -> float | None:
        """Seconds a ready replica has gone without a request (since it became ready, if
        it never had one); None for one not serving."""
        if r.state != ShardState.READY:
            return None
        return max(0.0, now - max(r.last_used, r.since))
