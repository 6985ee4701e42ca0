"""Messages from agents and routers, folded into the scheduler's state: reports into the
inventory, failures into parking, wants and activity into demand, logs to their waiter."""

from llmgw import bus, log
from llmgw.states import REPORTS, STARTING, MsgType, ShardState
from llmgw_scheduler.commands import Intents, LogRequests
from llmgw_scheduler.demand import Demand
from llmgw_scheduler.inventory import Inventory
from llmgw_scheduler.models import Catalog
from llmgw_scheduler.needs import Needs
from llmgw_scheduler.parking import Parking

_log = log.get("llmgw.scheduler")


class Messages:
    adapters = None  # the Adapters (adapters.py): wanted ones go there

    def __init__(self, inv: Inventory, catalog: Catalog, needs: Needs, parking: Parking,
                 demand: Demand, intents: Intents, logs: LogRequests, drained, cfg, flags,
                 leadership, clock, loads=None, counters=None,
                 coldstarts=None):  # fmt: skip
        self.inv = inv
        self.catalog = catalog
        self.needs = needs
        self.parking = parking
        self.demand = demand
        self.intents = intents
        self.logs = logs
        self.drained = drained  # node in drained: it is draining
        self.cfg = cfg  # the scheduler section: start_timeout_s
        self.flags = flags
        self.leadership = leadership  # .leading(), .epoch and .superseded(epoch, why)
        self.clock = clock
        self.loads = loads  # routers' load reports, for the autoscaler
        self.counters = counters  # engines' token counters, for the usage check
        self.coldstarts = coldstarts  # each model's start-to-ready seconds, for eviction

    def handle(self, sender: str, msg: dict) -> None:
        now = self.clock()
        body = msg["body"]
        kind = msg["type"]
        seen = msg.get("epoch", 0)
        lead = self.leadership
        if isinstance(seen, int) and seen > lead.epoch and lead.leading():
            # An agent has had a command from a newer leader: we have been replaced.
            lead.superseded(seen, f"node {sender} has seen epoch {seen}")
        if kind == MsgType.REFUSED:
            _log.warning("command_refused", node=sender, type=body.get("type"),
                         reason=body.get("reason"))  # fmt: skip
        elif kind in REPORTS:
            self._report(sender, body, now)
        elif kind == MsgType.SHARD_STATUS:
            self._shard_status(sender, body.get("shard") or {}, now)
        elif kind == MsgType.WANT:
            model = self.catalog.by_alias.get(body.get("model", ""))
            adapter = self.catalog.adapters.get(model or "")
            if adapter is not None:  # loaded on a replica of its base, started if need be
                if model not in self.adapters.wanted:
                    _log.info("adapter_wanted", adapter=model, by=sender)
                self.adapters.want(model, now)
                self.demand.want(model, sender, body.get("n"), now)
                self.demand.want(adapter.adapter_of, sender, None, now)
                self.flags.wake = True
            elif model is not None:
                m = self.catalog.models[model]
                if m.min == 0 and not self.demand.active(m, now) and lead.leading():
                    _log.info("model_wanted", model=model, by=sender)
                self.demand.want(model, sender, body.get("n"), now)
                self.flags.wake = True  # place it now, not at the next tick
        elif kind == MsgType.ACTIVITY:
            for name, idle in (body.get("idle_s") or {}).items():
                model = self.catalog.by_alias.get(name)
                if model is not None and isinstance(idle, int | float):
                    self.demand.used(model, idle, now)
                    if model in self.catalog.adapters:  # its base is in use too
                        self.demand.used(self.catalog.adapters[model].adapter_of, idle, now)
            for rid, idle in (body.get("replica_idle_s") or {}).items():
                r = self.inv.replicas.get(rid)
                if r is not None and isinstance(idle, int | float):
                    r.last_used = max(r.last_used, now - idle)
            if self.loads is not None:
                self.loads.report(sender, body, now)
        elif kind in (MsgType.LOGS, MsgType.FABRIC_READY, MsgType.FABRIC_RESULT):
            self.logs.answer(body)  # a waiter by request id (llmgw logs, llmgw fabric test)
        elif kind == MsgType.INSTALL_STATUS:
            node = self.inv.nodes.get(sender)
            if node is not None:
                # The whole entry, as a heartbeat's `engines` has it (accelerators, retry).
                node.engines[body.get("engine", "")] = {
                    **{k: v for k, v in body.items() if k not in ("node", "engine")},
                    "state": body.get("state", ""),
                    "reason": body.get("reason", ""),
                }
                _log.info("engine_install", node=sender, engine=body.get("engine"),
                          state=body.get("state"), reason=body.get("reason") or None)  # fmt: skip

    def _report(self, sender: str, body: dict, now: float) -> None:
        """A hello or heartbeat: the node's whole state."""
        node = self.inv.nodes.get(sender)
        if node is None or node.lost:
            memory = (body.get("resources") or {}).get("memory_available", 0)
            _log.info("node_up", node=sender, memory_gib=_gib(memory))
        self.inv.node_report(sender, body, now).draining = sender in self.drained
        shards = body.get("shards") or []
        starting = [r for r in self.inv.on_node(sender) if r.state in STARTING]
        changed, vanished = self.inv.shards_report(
            sender, shards, now, grace_s=self.cfg.start_timeout_s
        )
        for r in starting:  # ready, and its shard_status missed
            if r.state == ShardState.READY:
                self._came_up(r, now)
        for s in shards:
            self.intents.reported(s.get("id"))
            if self.counters is not None and s.get("tokens"):
                self.counters.record(str(s.get("id")), str(s.get("model", "")), s["tokens"])
        for r in vanished:
            _log.warning("replica_vanished", replica=r.id, model=r.model, node=sender)
            if r.state != ShardState.STOPPING:
                self.parking.failed(r.model, now, counts=_a_start(r.state, r.orphaned))
        self.flags.routes_dirty |= changed

    def _shard_status(self, node: str, shard: dict, now: float) -> None:
        before = self.inv.replicas.get(shard.get("id"))
        was = before.state if before else None
        orphaned = before is not None and before.orphaned
        self.intents.reported(shard.get("id"))
        if not self.inv.shard_update(node, shard, now):
            return
        self.flags.routes_dirty = True
        state, model = shard.get("state"), shard.get("model", "")
        reason = (shard.get("reason") or "")[:300] or None
        if state != was:  # said once per change: not `state=starting was=starting`
            _log.info("replica_state", replica=shard.get("id"), model=model, node=node,
                      state=state, was=was, reason=reason)  # fmt: skip
        else:  # the same state on a new endpoint (the engine's port is known now)
            _log.debug("replica_endpoint", replica=shard.get("id"), state=state,
                       endpoint=shard.get("endpoint"))  # fmt: skip
        if state == ShardState.READY:
            self.parking.succeeded(model)
            if before is not None and was in STARTING:
                self._came_up(before, now)
            r = self.inv.replicas.get(shard.get("id"))
            m = self.catalog.of_replica(r) if r is not None else None
            # A gang's leader holds a part at most (its workers hold the weights): its
            # size is no measure of the model's, and once taught the scheduler that a
            # model bigger than any node fits on one.
            leader = self.inv.replicas.get(shard.get("id"))
            if (m is not None and shard.get("rss") and self.leadership.leading()
                    and not (leader is not None and leader.memory >= 0)):  # fmt: skip
                self.needs.record(m, int(shard["rss"]))  # a standby writes nothing
        elif state == ShardState.FAILED and was != ShardState.STOPPING:
            reason = shard.get("reason") or ""
            # An engine that died after it was ready still backs off (its failures start
            # again at its next ready); one gone with its node or agent is no failure.
            counts = not orphaned and reason != bus.GONE_AFTER_AGENT_RESTART
            self.parking.failed(model, now, reason, counts=counts)

    def _came_up(self, r, now: float) -> None:
        """A replica we saw start is ready: how long its model takes to come back."""
        if self.coldstarts is not None and not r.role:
            self.coldstarts.record(r.model, now - r.created)


def _a_start(state: str | None, orphaned: bool) -> bool:
    """Whether a replica that vanished from its node's heartbeat in `state` was a start
    that failed: not one that had served (the agent lost it, not its engine), and not one
    whose node was lost meanwhile. One we never heard of (None) was starting."""
    return not orphaned and (state is None or state in STARTING)


def _gib(n) -> str:
    return f"{int(n or 0) / 2**30:.1f}"
