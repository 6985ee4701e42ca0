"""The scheduler's state and passes: agent messages in, commands and routes out.

Decisions are made by the pure reconciler; this module
turns agent messages into its inputs and its decisions into messages. Nothing is
started until `settle_s` after our own start, so agents can tell us what already
runs: a restarted scheduler must not start a replica twice.
"""

import dataclasses
import json
import random
import secrets
import threading
import time

from llmgw import apikeys, audit, bus, catalog, config, log, restarts
from llmgw.catalog import Model
from llmgw.errors import ConfigError, Conflict, Invalid, NotFound
from llmgw.placement import NodeView, place
from llmgw.reconciler import Backoff, Desired, ReplicaView, after_failure, after_success, reconcile
from llmgw.states import LIVE, REPORTS, STARTING, ModelState, MsgType, ShardState
from llmgw.store import (
    DrainedNode,
    ModelScale,
    ParkedModel,
    ReplicaIntent,
    RuntimeModel,
    drop_connection,
)
from llmgw_scheduler.inventory import Inventory, Replica
from llmgw_scheduler.needs import Needs

_log = log.get("llmgw.scheduler")

# Failed starts in a row before a model is parked: a model whose weights its engine could
# not load was once started 155 times over eight hours.
PARK_AFTER = 5
# After an eviction's victim is gone, how long its room may take to show in the agents'
# reports before the model it was evicted for is unplaceable again.
ROOM_GRACE_S = 10.0


class Scheduler:
    def __init__(
        self, cfg, models: list[Model], cluster_secret: str, needs: Needs, clock=time.time, rng=None
    ):
        self.cfg = cfg.scheduler
        self.models = {m.name: m for m in models}
        self.cluster_secret = cluster_secret
        self.needs = needs
        self.clock = clock
        self.rng = rng or random.Random()
        self.inv = Inventory()
        self.backoff: dict[str, Backoff] = {}
        self.started_at = clock()
        # When our last pass as leader ran (None: none since we started or took over):
        # fleet metrics wait for it, as routes do, so they never show a half-heard fleet.
        self.last_pass_at: float | None = None
        self.epoch = 0
        self.seq = 0
        self.routes_dirty = True
        self.wake = False  # run a pass now, not at the next tick (set by the admin API)
        self.next_snapshot = 0.0
        self.next_tick = 0.0
        self.outbox: list[tuple[str, bytes]] = []  # (node, message) to send
        self._installs_asked: dict[tuple[str, str], float] = {}
        self.unplaceable: dict[str, str] = {}  # model -> why it fits nowhere
        self._unplaceable_logged: dict[str, float] = {}
        self.last_error: dict[str, str] = {}  # model -> its last failed start's reason
        self.registered_nodes: list[str] = []  # from the store, for `llmgw nodes`
        self.drained: dict[str, float] = {}  # node -> draining since
        self.last_active: dict[str, float] = {}  # model -> when a router last used it
        # model -> when it was evicted: only requests after that make it active again
        self.evicted_at: dict[str, float] = {}
        # On-demand wants, numbered by each router: (model, router) -> the newest want
        # not yet answered by a pass, and model -> router -> the newest answered. A router
        # waits for the answer to its own want, never on an older one (room may have been
        # made since), and an answer of "unplaceable" is given at once, not after 60 s.
        self._wants_pending: dict[tuple[str, str], int] = {}
        self.answered: dict[str, dict[str, int]] = {}
        # model -> (the model evicted for it, until when room is still coming)
        self.making_room: dict[str, tuple[str, float]] = {}
        # The raw definitions behind self.models, and which came from the config file.
        self.log_requests: dict[str, dict] = {}  # request id -> {"done", "reply"}
        self.model_configs: list = []
        self.config_names: set[str] = set()
        self.extra_engines: set[str] = set()
        self._by_alias = {a: m.name for m in models for a in (m.name, *m.aliases)}
        self.parked: dict[str, ParkedModel] = {}
        # `llmgw restart`: active ones in queue order, then the most recent that ended.
        self.restarts: list[restarts.Restart] = []
        # The admin API reads and changes this object from its own thread.
        self.lock = threading.RLock()
        # Leadership (set by main): whether we may act now, and how to say we may not.
        self.name = "scheduler"
        self.leadership = None  # the Leadership, for the admin API's status
        self.leading = lambda: True
        self.superseded = lambda epoch, why: None
        self.intents: set[str] = set()  # replica ids with a start intent in the store
        self._intents_done: set[str] = set()  # reported by their agent: delete the intent

    # -- messages from agents ----------------------------------------------------------

    def handle(self, sender: str, msg: dict) -> None:
        now = self.clock()
        body = msg["body"]
        kind = msg["type"]
        seen = msg.get("epoch", 0)
        if isinstance(seen, int) and seen > self.epoch and self.leading():
            # An agent has had a command from a newer leader: we have been replaced.
            self.superseded(seen, f"node {sender} has seen epoch {seen}")
        if kind == MsgType.REFUSED:
            _log.warning("command_refused", node=sender, type=body.get("type"),
                         reason=body.get("reason"))  # fmt: skip
            return
        if kind in REPORTS:
            node = self.inv.nodes.get(sender)
            if node is None or node.lost:
                _log.info(
                    "node_up",
                    node=sender,
                    memory_gib=_gib((body.get("resources") or {}).get("memory_available", 0)),
                )
            self.inv.node_report(sender, body, now).draining = sender in self.drained
            changed, vanished = self.inv.shards_report(
                sender, body.get("shards") or [], now, grace_s=self.cfg.start_timeout_s
            )
            self._intents_done.update(
                s.get("id") for s in body.get("shards") or () if s.get("id") in self.intents
            )
            for r in vanished:
                _log.warning("replica_vanished", replica=r.id, model=r.model, node=sender)
                if r.state != ShardState.STOPPING:
                    self._failed(r.model, now, counts=_a_start(r.state, r.orphaned))
            self.routes_dirty |= changed
        elif kind == MsgType.SHARD_STATUS:
            shard = body.get("shard") or {}
            before = self.inv.replicas.get(shard.get("id"))
            before_state = before.state if before else None
            orphaned = before is not None and before.orphaned
            if shard.get("id") in self.intents:
                self._intents_done.add(shard["id"])
            if self.inv.shard_update(sender, shard, now):
                self.routes_dirty = True
                self._shard_changed(sender, shard, before_state, now, orphaned)
        elif kind == MsgType.WANT:
            model = self._by_alias.get(body.get("model", ""))
            if model is not None:
                m = self.models[model]
                if m.min == 0 and not self.active(m, now) and self.leading():
                    _log.info("model_wanted", model=model, by=sender)
                self.last_active[model] = now
                n = body.get("n")
                if isinstance(n, int) and not isinstance(n, bool):
                    key = (model, sender)
                    self._wants_pending[key] = max(n, self._wants_pending.get(key, 0))
                self.wake = True  # place it now, not at the next tick
        elif kind == MsgType.ACTIVITY:
            for name, idle in (body.get("idle_s") or {}).items():
                model = self._by_alias.get(name)
                if model is None or not isinstance(idle, int | float):
                    continue
                used = now - idle
                if used > self.evicted_at.get(model, float("-inf")):
                    self.last_active[model] = max(self.last_active.get(model, 0.0), used)
            for rid, idle in (body.get("replica_idle_s") or {}).items():
                r = self.inv.replicas.get(rid)
                if r is not None and isinstance(idle, int | float):
                    r.last_used = max(r.last_used, now - idle)
        elif kind == MsgType.LOGS:
            waiter = self.log_requests.get(body.get("request", ""))
            if waiter is not None:
                waiter["reply"] = body
                waiter["done"].set()
        elif kind == MsgType.INSTALL_STATUS:
            node = self.inv.nodes.get(sender)
            if node is not None:
                node.engines[body.get("engine", "")] = {
                    "state": body.get("state", ""),
                    "reason": body.get("reason", ""),
                }
                _log.info(
                    "engine_install",
                    node=sender,
                    engine=body.get("engine"),
                    state=body.get("state"),
                    reason=body.get("reason") or None,
                )

    def _shard_changed(self, node: str, shard: dict, before: str | None, now: float,
                       orphaned: bool = False) -> None:  # fmt: skip
        state, model = shard.get("state"), shard.get("model", "")
        _log.info(
            "replica_state",
            replica=shard.get("id"),
            model=model,
            node=node,
            state=state,
            was=before,
            reason=(shard.get("reason") or "")[:300] or None,
        )
        if state == ShardState.READY:
            self.backoff[model] = after_success(self.backoff.get(model, Backoff()))
            m = self.models.get(model)
            if m is not None and shard.get("rss") and self.leading():  # a standby writes nothing
                self.needs.record(m, int(shard["rss"]))
        elif state == ShardState.FAILED and before != ShardState.STOPPING:
            reason = shard.get("reason") or ""
            # An engine that died after it was ready still backs off (its failures start
            # again at its next ready); one gone with its node or agent is no failure.
            counts = not orphaned and reason != bus.GONE_AFTER_AGENT_RESTART
            self._failed(model, now, reason, counts=counts)

    def _failed(self, model: str, now: float, reason: str = "", counts: bool = True) -> None:
        """A replica of `model` failed. Only its engine's failure (`counts`: not a node
        lost, an agent restarted, or a served replica vanishing from a heartbeat) backs
        off and counts toward parking: a node crash once counted as one, so five crashes
        would have parked a healthy model. A standby keeps the count quietly: retrying
        is the leader's to say."""
        if not counts:
            return
        if reason:
            self.last_error[model] = reason[-2000:]
        b = after_failure(
            self.backoff.get(model, Backoff()),
            now,
            self.rng,
            self.cfg.backoff_base_s,
            self.cfg.backoff_max_s,
        )
        self.backoff[model] = b
        if self.leading():
            _log.warning("start_failed", model=model, failures=b.failures,
                         retry_in_s=round(b.next_at - now, 1))  # fmt: skip
        m = self.models.get(model)
        if m is not None and b.failures >= PARK_AFTER and model not in self.parked:
            if self.leading():  # a standby reads the park from the store when it takes over
                self._park(m, b.failures, now)

    # -- draining ------------------------------------------------------------------------

    def load_drained(self) -> None:
        for row in DrainedNode.select():
            self.drained[row.name] = row.since

    def known_node(self, node: str) -> None:
        """NotFound unless `node` has reported or is registered."""
        if node not in self.inv.nodes and node not in self.registered_nodes:
            raise NotFound(f"no node '{node}'", "node_not_found")

    def drain(self, node: str, now: float) -> None:
        self.known_node(node)
        DrainedNode.insert(name=node, since=now).on_conflict_ignore().execute()
        self.drained.setdefault(node, now)
        if node in self.inv.nodes:
            self.inv.nodes[node].draining = True
        self.wake = self.routes_dirty = True
        _log.info("node_draining", node=node, replicas=len(self.inv.on_node(node)))

    def undrain(self, node: str) -> None:
        self.known_node(node)
        DrainedNode.delete().where(DrainedNode.name == node).execute()
        self.drained.pop(node, None)
        if node in self.inv.nodes:
            self.inv.nodes[node].draining = False
        self.wake = self.routes_dirty = True
        _log.info("node_undrained", node=node)

    def _drain_pass(self, now: float) -> None:
        """Stop replicas on draining nodes that are no longer needed: each once its model
        keeps `min` ready replicas without it, or once the grace period is over."""
        lost = {n.id for n in self.inv.nodes.values() if n.lost}
        ready: dict[str, int] = {}
        for r in self.inv.replicas.values():
            if r.state == ShardState.READY and r.node not in lost:
                ready[r.model] = ready.get(r.model, 0) + 1
        leaving = sorted(
            (r for r in self.inv.replicas.values() if r.node in self.drained and r.state in LIVE),
            key=lambda r: r.since,
        )
        for r in leaving:
            m = self.models.get(r.model)
            overdue = now - self.drained[r.node] >= self.cfg.drain_grace_s
            if r.state != ShardState.READY:
                self._stop(r.id, now)  # not serving anyway
            elif m is None or overdue or ready.get(r.model, 0) - 1 >= m.min:
                ready[r.model] = ready.get(r.model, 0) - 1
                self._stop(r.id, now)

    def connected(self, node: str) -> None:
        """NotFound unless `node` has reported and is not lost."""
        if node not in self.inv.nodes or self.inv.nodes[node].lost:
            raise NotFound(f"node '{node}' is not connected", "node_not_found")

    def ask_logs(self, node: str, shard: str, lines: int) -> dict:
        """Queue a get_logs for the admin API; it waits on the returned entry's event."""
        self.connected(node)
        request = secrets.token_hex(8)
        entry = {"done": threading.Event(), "reply": None}
        self.log_requests[request] = entry
        self._send(node, MsgType.GET_LOGS, {"id": shard, "lines": lines, "request": request})
        entry["request"] = request
        return entry

    # -- the catalog: the config's models, plus those added at runtime ------------------

    def install_catalog(self, configs: list) -> None:
        """Check `configs` as a whole (names, aliases, fallbacks), apply `llmgw scale`
        overrides and make them the catalog. Raises ConfigError and changes nothing
        if any definition is wrong."""
        checked = catalog.load(configs, self.extra_engines)
        scales = {row.name: row for row in ModelScale.select()}
        models = {}
        for m in checked:
            s = scales.get(m.name)
            models[m.name] = dataclasses.replace(m, min=s.min, max=s.max) if s else m
        self.model_configs = list(configs)
        self.models = models
        self._by_alias = {a: m.name for m in checked for a in (m.name, *m.aliases)}
        for gone in [name for name in self.parked if name not in models]:
            del self.parked[gone]
        self.routes_dirty = True

    def load_runtime_models(self) -> None:
        """Add the models added with `llmgw models add`; one that no longer fits beside
        the config's (a name now taken there, say) is skipped with a log line."""
        for row in RuntimeModel.select().order_by(RuntimeModel.created_at):
            try:
                mc = config.model_from(json.loads(row.definition), f"model '{row.name}'")
                self.install_catalog([*self.model_configs, mc])
            except (ConfigError, ValueError) as e:
                _log.error("runtime_model_skipped", model=row.name, reason=str(e))

    def add_model(self, data: dict, now: float) -> Model:
        """`llmgw models add`: check, install and keep a new model definition. Raises
        Conflict for a name taken, Invalid for a definition that is wrong."""
        try:
            mc = config.model_from(data, f"model '{data.get('name', '?')}'")
            if mc.name in self._by_alias:
                raise Conflict(f"model '{mc.name}' exists already", "invalid_model")
            self.install_catalog([*self.model_configs, mc])
        except ConfigError as e:
            raise Invalid(str(e), "invalid_model") from None
        RuntimeModel.insert(name=mc.name, definition=json.dumps(data), created_at=now).execute()
        self.wake = True
        _log.info("model_added", model=mc.name)
        return self.models[mc.name]

    def remove_model(self, name: str) -> None:
        """`llmgw models remove`: only runtime models; its replicas are stopped."""
        if name in self.config_names:
            raise Conflict(
                f"model '{name}' is defined in the config file: remove it there",
                "defined_in_config",
            )
        if RuntimeModel.get_or_none(RuntimeModel.name == name) is None:
            raise NotFound(f"no runtime model '{name}'", "model_not_found")
        self.install_catalog([mc for mc in self.model_configs if mc.name != name])
        RuntimeModel.delete().where(RuntimeModel.name == name).execute()
        ModelScale.delete().where(ModelScale.name == name).execute()
        ParkedModel.delete().where(ParkedModel.model == name).execute()
        self.wake = True
        _log.info("model_removed", model=name)

    def scale(self, name: str, min_: int, max_: int, now: float) -> None:
        """`llmgw scale`: new bounds that outlive restarts and definition edits."""
        self.model(name)
        if min_ < 0 or max_ < 1 or min_ > max_:
            raise Invalid(f"min {min_} / max {max_}: want 0 <= min <= max, max >= 1")
        fields = {"min": min_, "max": max_, "updated_at": now}
        (
            ModelScale.insert(name=name, **fields)
            .on_conflict(conflict_target=[ModelScale.name], update=fields)
            .execute()
        )
        self.install_catalog(self.model_configs)
        self.wake = True
        _log.info("model_scaled", model=name, min=min_, max=max_)

    def model(self, name: str) -> Model:
        """The catalog's model `name`, or NotFound."""
        m = self.models.get(name)
        if m is None:
            raise NotFound(f"no model '{name}'", "model_not_found")
        return m

    # -- parking -------------------------------------------------------------------------

    def load_parked(self) -> None:
        """Parked models survive a restart, unless their definition changed meanwhile."""
        for row in ParkedModel.select():
            m = self.models.get(row.model)
            if m is not None and m.profile_hash() == row.profile:
                self.parked[row.model] = row
            else:
                _log.info("model_unparked", model=row.model, why="definition changed")
                row.delete_instance()

    def _park(self, m: Model, failures: int, now: float) -> None:
        reason = self.last_error.get(m.name) or "its engine did not become ready"
        fields = {
            "profile": m.profile_hash(),
            "reason": reason,
            "failures": failures,
            "parked_at": now,
        }
        (
            ParkedModel.insert(model=m.name, **fields)
            .on_conflict(conflict_target=[ParkedModel.model], update=fields)
            .execute()
        )
        self.parked[m.name] = ParkedModel(model=m.name, **fields)
        self.routes_dirty = True
        _log.error(
            "model_parked",
            model=m.name,
            failures=failures,
            reason=reason.strip().splitlines()[-1][:300] if reason.strip() else None,
            action="run `llmgw retry MODEL` once fixed",
        )

    def retry(self, model: str) -> bool:
        """Forget a model's failures and park, and place it at once."""
        self.model(model)
        ParkedModel.delete().where(ParkedModel.model == model).execute()
        self.parked.pop(model, None)
        self.backoff.pop(model, None)
        self.routes_dirty = True
        self.wake = True
        _log.info("model_retry", model=model)

    def model_status(self, model: str) -> tuple[str, str]:
        """(state, reason): serving, starting, backoff, parked, unplaceable or stopped."""
        if model in self.parked:
            return ModelState.PARKED, self.parked[model].reason
        lost = self.inv.lost_nodes()
        ready = sum(
            1
            for r in self.inv.replicas.values()
            if r.model == model and r.state == ShardState.READY and r.node not in lost
        )
        if ready:
            return ModelState.SERVING, ""
        if model in self.making_room:
            return (
                ModelState.STARTING,
                f"making room: {self.making_room[model][0]} is being stopped",
            )
        if model in self.unplaceable:
            return ModelState.UNPLACEABLE, self.unplaceable[model]
        b = self.backoff.get(model)
        if b is not None and b.failures and b.next_at > self.clock():
            return ModelState.BACKOFF, self.last_error.get(model, "")
        m = self.models[model]
        if m.min == 0 and not self.active(m, self.clock()):
            return ModelState.STOPPED, ""
        return ModelState.STARTING, ""

    # -- restarts ------------------------------------------------------------------------

    def restart(self, ids: list[str], now: float, max_surge: int = 1, max_unavailable: int = 1,
                in_place: bool = False) -> list[restarts.Restart]:  # fmt: skip
        """Queue restarts of replicas `ids`; NotFound names the first unknown one. A
        replica already queued or being replaced keeps its restart."""
        for rid in ids:
            r = self.inv.replicas.get(rid)
            if r is None or r.state not in LIVE:
                raise NotFound(
                    f"no running replica '{rid}' (see `llmgw replicas`)", "replica_not_found"
                )
        active = {job.replica: job for job in self.restarts if job.active}
        out = []
        for rid in ids:
            job = active.get(rid)
            if job is None:
                r = self.inv.replicas[rid]
                job = restarts.Restart(rid, r.model, r.node, now, max_surge, max_unavailable,
                                       in_place)  # fmt: skip
                self.restarts.insert(sum(1 for j in self.restarts if j.active), job)
                _log.info("restart_queued", replica=rid, model=r.model, node=r.node,
                          max_surge=max_surge, max_unavailable=max_unavailable,
                          in_place=in_place)  # fmt: skip
            out.append(job)
        self.wake = True
        return out

    def _restart_pass(self, now: float) -> None:
        replicas = {
            r.id: ReplicaView(r.id, r.model, r.node, r.state, r.since)
            for r in self.inv.replicas.values()
        }
        needs = {m.name: self.needs.need(m) for m in self.models.values()}
        # What node_views() counts each replica as taking: its need, or more if it grew.
        holds = {
            r.id: max(needs[r.model].memory, r.rss)
            for r in self.inv.replicas.values()
            if r.model in needs
        }
        steps = restarts.plan(
            [j for j in self.restarts if j.active],
            replicas,
            self.node_views(),
            needs,
            now,
            # Beyond the replacement's own start timeout: stopping the old one comes first.
            2 * self.cfg.start_timeout_s,
            holds,
            deadline_s=self.cfg.restart_deadline_s,
        )
        for job, node in steps.surge:
            job.replacement = self._start(job.model, node, now) or ""
            _log.info("restart_replacing", replica=job.replica, model=job.model,
                      replacement=job.replacement, node=node, how=job.how)  # fmt: skip
        for job in steps.stop_now:
            _log.info("restart_replacing", replica=job.replica, model=job.model,
                      node=job.node, how=job.how)  # fmt: skip
            self._stop(job.replica, now)
        for job in steps.retire:
            self._stop(job.replica, now)
        for job in steps.ended:
            if job.state == restarts.DONE:
                _log.info("restart_done", replica=job.replica, model=job.model, how=job.how,
                          outcome=job.reason)  # fmt: skip
            else:
                _log.warning("restart_given_up", replica=job.replica, model=job.model,
                             reason=job.reason)  # fmt: skip
                self._audit("restart.given_up", job.replica, model=job.model,
                            reason=job.reason)  # fmt: skip
        if steps.ended:
            active = [j for j in self.restarts if j.active]
            ended = [j for j in self.restarts if not j.active][-restarts.KEEP_ENDED :]
            self.restarts = active + ended

    def _audit(self, action: str, target: str, **detail) -> None:
        """What the scheduler decided on an operator's behalf, beside their changes in the
        audit log (actor `scheduler`); a store that cannot take it leaves the log line."""
        try:
            audit.record(action, "scheduler", "", target, now=self.clock(), **detail)
        except Exception as e:
            _log.error("audit_write_failed", action=action, target=target, reason=str(e)[:200])
            drop_connection()

    def restart_state(self, replica: str) -> str | None:
        """'queued' or 'replacing' while a restart of `replica` is under way."""
        for job in self.restarts:
            if job.replica == replica and job.active:
                return job.state
        return None

    # -- leadership ------------------------------------------------------------------------

    def take_over(self, epoch: int, now: float) -> None:
        """We lead from now, with `epoch`. Wait for fresh heartbeats before placing (the
        settle time starts again), give every node its full node-lost time from now, and
        read what the store says — the catalog, parks, drains, and the replicas the last
        leader was starting — so nothing is started twice."""
        self.epoch = epoch
        self.started_at = now
        self.last_pass_at = None
        for node in self.inv.nodes.values():
            node.last_seen = max(node.last_seen, now)
        dropped = [j.replica for j in self.restarts if j.active]
        self.restarts = [j for j in self.restarts if not j.active]
        if dropped:
            _log.warning("restarts_dropped", replicas=",".join(dropped),
                         why="leadership changed; run llmgw restart again")  # fmt: skip
        self.install_catalog([mc for mc in self.model_configs if mc.name in self.config_names])
        self.load_runtime_models()
        self.parked.clear()
        self.load_parked()
        self.drained.clear()
        self.load_drained()
        for node in self.inv.nodes.values():
            node.draining = node.id in self.drained
        for row in ReplicaIntent.select():
            self.intents.add(row.id)
            if now - row.created_at > self.cfg.start_timeout_s:
                self._intents_done.add(row.id)  # long settled one way or the other
            elif row.id not in self.inv.replicas:
                # Asked for by the last leader, not reported yet: count it as pending, so
                # it is not started again; the start timeout removes it if it never comes.
                self.inv.replicas[row.id] = Replica(
                    row.id, row.model, row.node, row.profile, ShardState.PENDING, now
                )
        self.routes_dirty = True
        for node in self.inv.nodes:
            self._send(node, MsgType.LEADER, {"epoch": epoch, "name": self.name})
        _log.info("took_over", epoch=epoch, nodes=len(self.inv.nodes),
                  replicas=len(self.inv.replicas), intents=len(self.intents))  # fmt: skip

    def step_down(self) -> None:
        """We no longer lead: send nothing more, keep listening (a warm standby)."""
        self.outbox.clear()

    def standby_tick(self) -> None:
        """A standby's pass: keep the inventory's node states current, decide nothing."""
        self.inv.mark_lost(self.clock(), self.cfg.node_lost_s)

    def _forget_intents(self) -> None:
        """Intents whose replicas an agent has reported are done with."""
        done = self._intents_done & self.intents
        self._intents_done.clear()
        if not done:
            return
        try:
            ReplicaIntent.delete().where(ReplicaIntent.id.in_(list(done))).execute()
            self.intents -= done
        except Exception as e:  # the store is down: try again on the next pass
            self._intents_done |= done
            _log.debug("intents_not_deleted", reason=str(e)[:200])
            drop_connection()

    # -- the periodic pass ---------------------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        for node in self.inv.mark_lost(now, self.cfg.node_lost_s):
            _log.warning(
                "node_lost",
                node=node.id,
                silent_s=round(now - node.last_seen, 1),
                replicas=len(self.inv.on_node(node.id)),
            )
            self.routes_dirty = True
        self._expire_pending(now)
        self._forget_intents()
        if not self.settled(now):
            return
        asked, self._wants_pending = self._wants_pending, {}
        desired = [self._desired(m, now) for m in self.models.values() if m.name not in self.parked]
        self._restart_pass(now)
        # Replicas on draining nodes do not count, so replacements start elsewhere; the
        # drain pass stops each once it is no longer needed. A replica being replaced
        # beside itself does not count either (its replacement does), and one being
        # replaced in place still does until it is gone, so nothing else is started.
        surging = {r.replica for r in self.restarts if r.state == restarts.REPLACING}
        views = [
            ReplicaView(r.id, r.model, r.node, r.state, r.since)
            for r in self.inv.replicas.values()
            if r.state in LIVE and r.node not in self.drained and r.id not in surging
        ]
        for job in self.restarts:
            old = self.inv.replicas.get(job.replica)
            if job.state == restarts.REPLACING and job.how == restarts.IN_PLACE and old:
                views.append(
                    ReplicaView(old.id, old.model, old.node, ShardState.PENDING, old.since)
                )
        decisions = reconcile(desired, views, self.node_views(), self.backoff, now)
        for model, node, install in decisions.starts:
            if install:
                self._install(node, self.models[model])
            else:
                self._start(model, node, now)
        for rid in decisions.stops:
            self._stop(rid, now)
        self._drain_pass(now)
        self._evict_for(decisions.unplaceable, now)
        self._report_unplaceable(decisions.unplaceable)
        self._room_coming(now)
        self.last_pass_at = now
        for (model, router), n in asked.items():  # this pass is their answer
            mine = self.answered.setdefault(model, {})
            mine[router] = max(n, mine.get(router, 0))
            self.routes_dirty = True

    def _evict_for(self, unplaceable: dict, now: float) -> None:
        """Make room for a wanted on-demand model that fits nowhere by retiring the least
        recently used other on-demand model whose replicas free enough on some node.
        The evicted model just stops counting as active; the next pass stops its
        replicas, and the wanted one is placed once the agents report the memory free."""
        for name in unplaceable:
            wanted = self.models.get(name)
            if wanted is None or wanted.min > 0 or not self.active(wanted, now):
                continue
            need = self.needs.need(wanted)
            others = sorted(
                (
                    m
                    for m in self.models.values()
                    if m.min == 0 and m.name != name and self.active(m, now)
                ),
                key=lambda m: self.last_active.get(m.name, 0.0),
            )
            lost = self.inv.lost_nodes()
            for victim in others:
                freed: dict[str, int] = {}
                for r in self.inv.replicas.values():
                    if r.model == victim.name and r.state in LIVE and r.node not in lost:
                        freed[r.node] = freed.get(r.node, 0) + self.needs.need(victim).memory
                views = [
                    dataclasses.replace(v, memory_free=v.memory_free + freed.get(v.id, 0))
                    for v in self.node_views()
                ]
                if freed and place(need, views).node is not None:
                    _log.info(
                        "model_evicted",
                        model=victim.name,
                        for_model=name,
                        idle_s=round(now - self.last_active.get(victim.name, now), 1),
                    )
                    self.last_active[victim.name] = float("-inf")
                    self.evicted_at[victim.name] = now
                    self.making_room[name] = (victim.name, now + ROOM_GRACE_S)
                    self.wake = True
                    break

    def _room_coming(self, now: float) -> None:
        """Keep a model whose eviction is under way `starting`, not `unplaceable`, until
        its victim's replicas are gone and the agents have reported the memory free."""
        for name, (victim, until) in list(self.making_room.items()):
            if name not in self.unplaceable:
                del self.making_room[name]  # placed, or no longer wanted
            elif any(r.model == victim for r in self.inv.replicas.values()):
                self.making_room[name] = (victim, now + ROOM_GRACE_S)
            elif now >= until:
                del self.making_room[name]

    def active(self, m: Model, now: float) -> bool:
        """An on-demand model is active from a request until keep_alive_s after the last."""
        return now - self.last_active.get(m.name, float("-inf")) < m.keep_alive_s

    def desired_now(self, m: Model, now: float) -> int:
        """The replicas `m` should have now: its min, or 1 for an on-demand one in use."""
        return m.min if m.min > 0 else int(self.active(m, now))

    def _desired(self, m: Model, now: float) -> Desired:
        need = self.needs.need(m)
        if m.min > 0:
            return Desired(m.name, m.min, m.max, need)
        if self.active(m, now):
            return Desired(m.name, 1, m.max, need)
        return Desired(m.name, 0, 0, need)  # idle: stop what runs

    def idle_s(self, r: Replica, now: float) -> float | None:
        """Seconds a ready replica has gone without a request (since it became ready, if
        it never had one); None for one not serving."""
        if r.state != ShardState.READY:
            return None
        return max(0.0, now - max(r.last_used, r.since))

    def settled(self, now: float) -> bool:
        return now - self.started_at >= self.cfg.settle_s

    def node_views(self) -> list[NodeView]:
        views = []
        for node in self.inv.nodes.values():
            here = self.inv.on_node(node.id)
            # The node's reported free memory already lacks what its replicas use now.
            # Reserve what they are expected to use on top: all of it for one still
            # loading, the rest of it for one whose resident size is below the need
            # (llama.cpp maps weights in as pages are touched).
            reserved = sum(
                max(0, self.needs.need(self.models[r.model]).memory - r.rss)
                for r in here
                if r.state in LIVE and r.model in self.models
            )
            counts: dict[str, int] = {}
            for r in here:
                if r.state in LIVE:
                    counts[r.model] = counts.get(r.model, 0) + 1
            engines = {}
            for eid, info in node.engines.items():
                state = info.get("state", "")
                engines[eid] = (
                    f"failed: {info.get('reason', '')}" if state == ShardState.FAILED else state
                )
            gpus_free = tuple(int(g.get("memory_free", 0)) for g in node.gpus)
            views.append(NodeView(
                id=node.id, lost=node.lost, draining=node.draining,
                memory_free=max(0, node.memory_available - reserved),
                gpus_free=gpus_free, engines=engines, replicas=counts,
            ))  # fmt: skip
        return views

    def _expire_pending(self, now: float) -> None:
        for r in list(self.inv.replicas.values()):
            if r.state in STARTING and now - r.since > self.cfg.start_timeout_s:
                _log.warning(
                    "start_timed_out", replica=r.id, model=r.model, node=r.node, state=r.state
                )
                self.inv.replicas.pop(r.id)
                self._send(r.node, MsgType.STOP_SHARD, {"id": r.id})
                lost = r.orphaned or r.node in self.inv.lost_nodes()
                self._failed(r.model, now, counts=not lost)
                if r.id in self.intents:
                    self._intents_done.add(r.id)

    # -- commands to agents ------------------------------------------------------------

    def _start(self, model_name: str, node: str, now: float) -> str | None:
        """Start a replica: the intent goes to the store first, so a leader that takes
        over knows it may be on its way; None if the store would not take it."""
        m = self.models[model_name]
        rid = "r-" + secrets.token_hex(4)
        try:
            ReplicaIntent.insert(id=rid, model=m.name, node=node, profile=m.profile_hash(),
                                 epoch=self.epoch, created_at=now).execute()  # fmt: skip
        except Exception as e:  # the store is down: start nothing we could not record
            _log.warning("intent_not_written", model=m.name, node=node, reason=str(e)[:200])
            drop_connection()
            return None
        self.intents.add(rid)
        key = apikeys.engine_key(self.cluster_secret, rid)
        self.inv.replicas[rid] = Replica(
            rid, m.name, node, m.profile_hash(), ShardState.PENDING, now, key=key
        )
        body = {
            "id": rid, "model": m.name, "profile": m.profile_hash(), "engine": m.engine,
            "engine_version": m.engine_version, "source": m.source, "sha256": m.sha256,
            "context": m.context, "parallel": m.parallel, "gpus": m.gpus,
            "args": list(m.args), "key": key,
        }  # fmt: skip
        _log.info("start_replica", replica=rid, model=m.name, node=node)
        self._send(node, MsgType.START_SHARD, body)
        return rid

    def _install(self, node: str, m: Model) -> None:
        key = (node, m.engine_id)
        now = self.clock()
        if now - self._installs_asked.get(key, -1e9) < 60:
            return
        self._installs_asked[key] = now
        _log.info("install_engine", node=node, engine=m.engine_id)
        self._send(node, MsgType.INSTALL_ENGINE, {"engine": m.engine, "version": m.engine_version})

    def _stop(self, rid: str, now: float) -> None:
        r = self.inv.replicas.get(rid)
        if r is None:
            return
        _log.info("stop_replica", replica=rid, model=r.model, node=r.node, state=r.state)
        r.state, r.since = ShardState.STOPPING, now
        self.routes_dirty = True
        self._send(r.node, MsgType.STOP_SHARD, {"id": rid})

    def _send(self, node: str, kind: str, body: dict) -> None:
        self.outbox.append((node, bus.encode(kind, "scheduler", body, self.epoch)))

    def _report_unplaceable(self, unplaceable: dict[str, dict[str, str]]) -> None:
        """Log when a model's reason changes, and every ten minutes while it lasts:
        never on every pass (250 identical lines in two days once buried everything)."""
        now = self.clock()
        for model, reasons in unplaceable.items():
            text = "; ".join(f"{n}: {why}" for n, why in sorted(reasons.items())) or "no nodes"
            changed = self.unplaceable.get(model) != text
            if changed or now - self._unplaceable_logged.get(model, 0) >= 600:
                _log.warning("no_placement", model=model, reasons=text[:500])
                self._unplaceable_logged[model] = now
            if changed:
                self.routes_dirty = True
            self.unplaceable[model] = text
        for model in list(self.unplaceable):
            if model not in unplaceable:
                del self.unplaceable[model]
                self._unplaceable_logged.pop(model, None)
                self.routes_dirty = True

    # -- routes --------------------------------------------------------------------------

    def routes(self) -> dict:
        """The routing table: ready replicas, keeping a lost node's replicas only while
        their model has no ready replica on a live node (its engines may well still run)."""
        lost = {n.id for n in self.inv.nodes.values() if n.lost}
        ready = [
            r for r in self.inv.replicas.values() if r.state == ShardState.READY and r.endpoint
        ]
        served_live = {r.model for r in ready if r.node not in lost}
        out = []
        for r in ready:
            if r.node in lost and r.model in served_live:
                continue
            m = self.models.get(r.model)
            out.append({
                "id": r.id, "model": r.model, "aliases": list(m.aliases) if m else [],
                "endpoint": r.endpoint, "key": apikeys.engine_key(self.cluster_secret, r.id),
                "state": ShardState.READY,
            })  # fmt: skip
        models = []
        for m in self.models.values():
            state, reason = self.model_status(m.name)
            entry = {"name": m.name, "aliases": list(m.aliases), "state": state,
                     "reason": reason[-500:]}  # fmt: skip
            if m.name in self.answered:
                entry["answered"] = dict(self.answered[m.name])  # router -> its want number
            models.append(entry)
        return {"seq": self.seq, "replicas": out, "models": models}


def _a_start(state: str | None, orphaned: bool) -> bool:
    """Whether a replica that vanished from its node's heartbeat in `state` was a start
    that failed: not one that had served (the agent lost it, not its engine), and not one
    whose node was lost meanwhile. One we never heard of (None) was starting."""
    return not orphaned and (state is None or state in STARTING)


def _gib(n) -> str:
    return f"{int(n or 0) / 2**30:.1f}"
