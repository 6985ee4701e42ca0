"""The scheduler: its parts, wired once here, and the pass that drives them.

Decisions are made by the pure reconciler; the parts turn agent messages into its inputs
(`messages.py`) and its decisions into commands (`commands.py`). Nothing is started until
`settle_s` after our own start, so agents can tell us what already runs: a restarted
scheduler must not start a replica twice.
"""

import dataclasses
import random
import threading
import time

from llmgw import log
from llmgw.catalog import Model
from llmgw.errors import NotFound
from llmgw.reconciler import Desired, ReplicaView, reconcile
from llmgw.states import LIVE, STARTING, MsgType, ShardState
from llmgw_scheduler.adapters import Adapters
from llmgw_scheduler.autoscale import Autoscaler
from llmgw_scheduler.coldstarts import ColdStarts
from llmgw_scheduler.commands import Commands, Intents, LogRequests, Outbox
from llmgw_scheduler.counters import EngineCounters
from llmgw_scheduler.demand import Demand
from llmgw_scheduler.drains import Drains
from llmgw_scheduler.eviction import Eviction
from llmgw_scheduler.flags import Flags
from llmgw_scheduler.gangs import Gangs
from llmgw_scheduler.inventory import Inventory
from llmgw_scheduler.load import Loads
from llmgw_scheduler.messages import Messages
from llmgw_scheduler.models import Catalog
from llmgw_scheduler.needs import Needs
from llmgw_scheduler.parking import Parking
from llmgw_scheduler.restarts import Restarts
from llmgw_scheduler.views import Unplaceable, Views

_log = log.get("llmgw.scheduler")
_COUNTED = (ShardState.PENDING, ShardState.STARTING, ShardState.READY)


class Role:
    """Whether we lead, with which epoch, and how to say we have been replaced. Without a
    Leadership (a test, a tool) we always lead."""

    def __init__(self, leadership=None):
        self.leadership = leadership
        self.epoch = 0  # ours, from take_over

    def leading(self) -> bool:
        return self.leadership is None or self.leadership.leading()

    def superseded(self, epoch: int, why: str) -> None:
        if self.leadership is not None and epoch > self.leadership.epoch:
            self.leadership.lose(why)


class Scheduler:
    def __init__(self, cfg, models: list[Model], cluster_secret: str, needs: Needs,
                 clock=time.time, rng=None, leadership=None, name: str = "scheduler",
                 config_names=(), extra_engines=()):  # fmt: skip
        s = self.cfg = cfg.scheduler
        self.name = name
        self.needs = needs
        self.clock = clock
        self.leadership = leadership  # for the admin API's status: the lease, the store
        self.replicator = None  # copies the mirror and releases from peers (main sets it)
        self.role = Role(leadership)
        self.leading = self.role.leading
        self.flags = Flags()
        self.inv = Inventory()
        self.catalog = Catalog(models, set(config_names), set(extra_engines))
        self.outbox = Outbox(self.role)
        self.intents = Intents()
        self.logs = LogRequests(self.outbox)
        self.commands = Commands(self.inv, self.outbox, self.intents, self.flags,
                                 cluster_secret, clock)  # fmt: skip
        self.parking = Parking(self.catalog, s, rng or random.Random(), self.leading,
                               self.flags)  # fmt: skip
        self.drains = Drains(self.inv, self.catalog, self.commands, s, self.flags)
        self.demand = Demand()
        self.loads = Loads()
        self.autoscaler = Autoscaler(self.catalog, self.inv, self.loads, clock)
        self.gangs = Gangs(self.inv, self.commands, self.parking, s, self.flags)
        self.unplaceable = Unplaceable(self.flags, clock)
        making_room: dict[str, tuple[str, float]] = {}
        self.views = Views(self.catalog, self.inv, needs, self.parking, self.demand,
                           self.unplaceable, making_room, cluster_secret, clock)  # fmt: skip
        self.coldstarts = ColdStarts()
        self.eviction = Eviction(self.catalog, self.inv, needs, self.demand,
                                 self.views.node_views, making_room, self.flags, s,
                                 self.coldstarts)  # fmt: skip
        self.views.eviction = self.eviction
        self.restarting = Restarts(self.inv, self.catalog, needs, self.commands,
                                   self.views.node_views, s, self.flags, clock)  # fmt: skip
        self.engine_counters = EngineCounters()  # for the usage check (usage_check.py)
        self.messages = Messages(self.inv, self.catalog, needs, self.parking, self.demand,
                                 self.intents, self.logs, self.drains, s, self.flags,
                                 self.role, clock, self.loads, self.engine_counters,
                                 self.coldstarts)  # fmt: skip
        self.adapters = Adapters(
            self.catalog, self.inv, self.outbox, self.demand, self.flags,
            lambda name, node: self.commands.mirror_of(self.catalog.adapters[name], node),
        )  # fmt: skip
        self.views.adapters = self.messages.adapters = self.adapters
        self.commands.assign = self.views.assign_gpus
        self.started_at = clock()
        # When our last pass as leader ran (None: none since we started or took over):
        # fleet metrics wait for it, as routes do, so they never show a half-heard fleet.
        self.last_pass_at: float | None = None
        self.last_decisions = None  # what the last pass decided (None: it decided nothing)
        self.seq = 0
        self.next_snapshot = 0.0
        self.next_tick = 0.0
        self.registered_nodes: list[str] = []  # from the store, for `llmgw nodes`
        # The admin API reads and changes this object from its own thread.
        self.lock = threading.RLock()
        self._intents_taken: set[str] = set()

    # -- what the admin API, metrics and the loop read -----------------------------------

    epoch = property(lambda self: self.role.epoch)
    models = property(lambda self: self.catalog.models)
    config_names = property(lambda self: self.catalog.config_names)
    parked = property(lambda self: self.parking.parked)
    backoff = property(lambda self: self.parking.backoff)
    restarts = property(lambda self: self.restarting.jobs)
    drained = property(lambda self: self.drains.drained)
    log_requests = property(lambda self: self.logs)
    evicted_at = property(lambda self: self.demand.evicted_at)

    @property
    def routes_dirty(self) -> bool:
        return self.flags.routes_dirty

    @routes_dirty.setter
    def routes_dirty(self, value: bool) -> None:
        self.flags.routes_dirty = value

    @property
    def wake(self) -> bool:
        return self.flags.wake

    @wake.setter
    def wake(self, value: bool) -> None:
        self.flags.wake = value

    def model(self, name: str) -> Model:
        return self.catalog.get(name)

    def model_status(self, model: str) -> tuple[str, str]:
        return self.views.model_status(model)

    def node_views(self):
        return self.views.node_views()

    def routes(self) -> dict:
        return self.views.routes(self.seq)

    def idle_s(self, r, now: float) -> float | None:
        return self.views.idle_s(r, now)

    def desired_now(self, m: Model, now: float) -> int:
        """What `m` should have now: the autoscaler's count, or for an on-demand model
        1 while in use."""
        if self.autoscaler.scales(m):
            return self.autoscaler.desired(m)
        return self.demand.desired_now(m, now)

    def desired_why(self, model: str) -> str:
        """Why a model wants what it does now: the last scaling decision, or what
        blocks the scale-up it wants."""
        return self.autoscaler.blocked.get(model) or self.autoscaler.reason(model)

    def active(self, m: Model, now: float) -> bool:
        return self.demand.active(m, now)

    def restart_state(self, replica: str) -> str | None:
        return self.restarting.state_of(replica)

    def settled(self, now: float) -> bool:
        return now - self.started_at >= self.cfg.settle_s

    # -- changes (the admin API's, under the lock) ---------------------------------------

    def load(self, configs: list) -> None:
        """At start: the config's models, the runtime ones, and the store's parks and drains."""
        self.install_catalog(configs)
        self.load_runtime_models()
        self.parking.load()
        self.drains.load()

    def install_catalog(self, configs: list) -> None:
        self.catalog.install(configs)
        self.parking.prune()
        self.flags.routes_dirty = True

    def load_runtime_models(self) -> None:
        self.catalog.load_runtime()
        self.parking.prune()
        self.flags.routes_dirty = True

    def add_model(self, data: dict, now: float) -> Model:
        m = self.catalog.add(data, now)
        self.flags.routes_dirty = self.flags.wake = True
        return m

    def remove_model(self, name: str) -> None:
        """`llmgw models remove`: only runtime models; its replicas are stopped."""
        self.catalog.remove(name)
        self.parking.removed(name)
        self.flags.routes_dirty = self.flags.wake = True

    def scale(self, name: str, min_: int, max_: int, now: float) -> None:
        self.catalog.scale(name, min_, max_, now)
        self.parking.prune()
        self.flags.routes_dirty = self.flags.wake = True

    def retry(self, model: str) -> None:
        self.parking.retry(model)

    def restart(self, ids: list[str], now: float, **how) -> list:
        return self.restarting.restart(ids, now, **how)

    def known_node(self, node: str) -> None:
        """NotFound unless `node` has reported or is registered."""
        if node not in self.inv.nodes and node not in self.registered_nodes:
            raise NotFound(f"no node '{node}'", "node_not_found")

    def drain(self, node: str, now: float) -> None:
        self.known_node(node)
        self.drains.drain(node, now)

    def undrain(self, node: str) -> None:
        self.known_node(node)
        self.drains.undrain(node)

    def forget_node(self, node: str) -> None:
        """A node removed from the store (`llmgw nodes remove`, here or on the other
        scheduler, or `--store`): gone from the inventory, its drain and every count, so
        it is not shown `lost` a minute later nor counted at a takeover. Its replicas go
        with it; the next pass replaces what the catalog still wants."""
        if node in self.registered_nodes:  # not "never seen" until the next refresh
            self.registered_nodes = [n for n in self.registered_nodes if n != node]
        if node not in self.inv.nodes and node not in self.drains.drained:
            return
        gone = self.inv.forget_node(node)
        self.drains.drained.pop(node, None)  # its row went with the peer's (peers.remove)
        self.flags.routes_dirty = self.flags.wake = True
        _log.info("node_forgotten", node=node, replicas=len(gone))

    def connected(self, node: str) -> None:
        """NotFound unless `node` has reported and is not lost."""
        if node not in self.inv.nodes or self.inv.nodes[node].lost:
            raise NotFound(f"node '{node}' is not connected", "node_not_found")

    def ask_logs(self, node: str, shard: str, lines: int) -> dict:
        self.connected(node)
        return self.logs.ask(node, shard, lines)

    # -- messages, leadership and the pass (the loop's, under the lock) ------------------

    def handle(self, sender: str, msg: dict) -> None:
        self.messages.handle(sender, msg)

    def leadership_changed(self, epoch: int, leading: bool) -> None:
        """Leadership's callback, on its own thread."""
        with self.lock:
            if leading:
                self.take_over(epoch, self.clock())
            else:
                self.step_down()

    def take_over(self, epoch: int, now: float) -> None:
        """We lead from now, with `epoch`. Wait for fresh heartbeats before placing (the
        settle time starts again), give every node its full node-lost time from now, and
        read what the store says — the catalog, parks, drains, and the replicas the last
        leader was starting — so nothing is started twice."""
        self.role.epoch = epoch
        self.started_at = now
        self.last_pass_at = None
        for node in self.inv.nodes.values():
            node.last_seen = max(node.last_seen, now)
        self.restarting.drop_active()
        self.autoscaler.states.clear()  # decided afresh from what runs, as at a start
        self.catalog.reload()
        self.parking.reload()
        self.drains.reload()
        self.intents.reload(self.inv, now, self.cfg.start_timeout_s)
        try:  # what the other scheduler pulled into the mirror while we stood by
            self.needs.load_mirrored()
        except Exception as e:  # the store is down: placement goes without disk figures
            _log.warning("mirrored_weights_unavailable", reason=str(e)[:200])
        self.flags.routes_dirty = True
        for node in self.inv.nodes:
            self.outbox.send(node, MsgType.LEADER, {"epoch": epoch, "name": self.name})
        _log.info("took_over", epoch=epoch, nodes=len(self.inv.nodes),
                  replicas=len(self.inv.replicas), intents=len(self.intents.ids))  # fmt: skip

    def step_down(self) -> None:
        """We no longer lead: send nothing more, keep listening (a warm standby)."""
        self.outbox.clear()

    def standby_tick(self) -> None:
        """A standby's pass: keep the inventory's node states current, decide nothing."""
        self.inv.mark_lost(self.clock(), self.cfg.node_lost_s)

    def tick(self) -> None:
        now = self.clock()
        self.last_decisions = None
        for node in self.inv.mark_lost(now, self.cfg.node_lost_s):
            _log.warning("node_lost", node=node.id, silent_s=round(now - node.last_seen, 1),
                         replicas=len(self.inv.on_node(node.id)))  # fmt: skip
            self.flags.routes_dirty = True
        self._expire_pending(now)
        self._intents_taken |= self.intents.take_done()
        if not self.settled(now):
            return
        asked = self.demand.take_asked()
        models, parked = self.catalog.models, self.parking.parked
        # Replicas on draining nodes do not count, so replacements start elsewhere; the
        # drain pass stops each once it is no longer needed.
        drained = self.drains.drained
        counted = self._counted(drained)
        self.autoscaler.pass_(counted, now)
        restarting = {j.model for j in self.restarting.jobs if j.active}
        for rid in self.autoscaler.to_give_back(counted, skip=restarting):
            self.commands.stop(rid, now)  # the least loaded: it finishes what it has
        # Models that span nodes are the gangs' to place (gangs.py), not the reconciler's.
        desired = [self._desired(m, now) for m in models.values()
                   if m.name not in parked and not m.split]  # fmt: skip
        self.restarting.pass_(now)
        views = [
            ReplicaView(r.id, r.model, r.node, r.state, r.since)
            for r in self.inv.replicas.values()
            if r.state in LIVE
            and r.node not in drained
            and not (r.model in models and models[r.model].split)
        ]
        views = self.restarting.counted(views)
        decisions = reconcile(desired, views, self.views.node_views(), self.parking.backoff, now)
        for model, node, install in decisions.starts:
            if install:
                self.commands.install(node, models[model])
            else:  # at the profile placement chose (the first where none is named)
                m = models[model].at(decisions.profiles.get(model, "")) or models[model]
                self.commands.start(m, node, now)
        for rid in decisions.stops:
            self.commands.stop(rid, now)
        split = {m.name: self.desired_now(m, now) for m in models.values() if m.split}
        if split or self.inv.workers or self.gangs.jobs:
            node_views = self.views.node_views()
            fabrics = {n.id: ((n.topology.get("fabric") or {}).get("label", ""),
                              (n.topology.get("fabric") or {}).get("address", ""))
                       for n in self.inv.nodes.values()}  # fmt: skip
            decisions.unplaceable.update(self.gangs.pass_(
                models, split, parked, self.parking.backoff, node_views, fabrics, drained,
                self.needs, now))  # fmt: skip
        self.drains.pass_(now)
        self.eviction.evict_for(decisions.unplaceable, now)
        self.unplaceable.report(decisions.unplaceable)
        self.autoscaler.report_blocked(decisions.unplaceable, self.needs,
                                       self.views.node_views())  # fmt: skip
        self.eviction.room_coming(self.unplaceable, now)
        self.adapters.pass_(now)
        self.last_pass_at = now
        self.last_decisions = decisions
        if self.demand.answer(asked):  # this pass is their answer
            self.flags.routes_dirty = True

    def _desired(self, m: Model, now: float) -> Desired:
        needs = self.needs.options(m)  # its profiles', tried in order
        if self.autoscaler.scales(m):
            d = Desired(m.name, self.autoscaler.desired(m), m.max, needs[0])
        else:
            d = self.demand.desired(m, needs[0], now)
        return dataclasses.replace(d, needs=needs) if len(needs) > 1 else d

    def _counted(self, drained) -> dict[str, list]:
        """model -> its replicas that count toward its desired count: pending, starting
        or ready on a node that is neither lost nor draining."""
        lost = self.inv.lost_nodes()
        out: dict[str, list] = {}
        for r in self.inv.replicas.values():
            if r.state in _COUNTED and r.node not in drained and r.node not in lost:
                out.setdefault(r.model, []).append(r)
        # A replica across nodes counts only if none of its nodes is lost or draining: a
        # gang being replaced for a drain counted twice, and the autoscaler gave back
        # the new one as a surplus the moment it was ready.
        models = self.catalog.models
        for name in [n for n in out if n in models and models[n].split]:
            out[name] = self.gangs.leaders(name, lost | set(drained))
        return out

    def _expire_pending(self, now: float) -> None:
        timeout = self.cfg.start_timeout_s
        for r in [r for r in self.inv.replicas.values() if r.state in STARTING]:
            if now - r.since <= timeout:
                continue
            _log.warning("start_timed_out", replica=r.id, model=r.model, node=r.node,
                         state=r.state)  # fmt: skip
            self.inv.remove(r.id)
            self.outbox.send(r.node, MsgType.STOP_SHARD, {"id": r.id})
            lost = r.orphaned or r.node in self.inv.lost_nodes()
            self.parking.failed(r.model, now, counts=not lost)
            self.intents.reported(r.id)

    # -- store writes kept off the lock --------------------------------------------------

    def write_behind(self) -> None:
        """The store writes a pass or a message queued that need not hold the lock: the
        deletion of intents an agent has reported. The loop calls it after releasing the
        lock, so admin requests do not wait on the store."""
        taken, self._intents_taken = self._intents_taken, set()
        if not taken:
            return
        deleted = self.intents.delete(taken)
        with self.lock:
            if deleted:
                self.intents.ids -= taken
            else:  # the store is down: again after the next pass
                self.intents.done |= taken
