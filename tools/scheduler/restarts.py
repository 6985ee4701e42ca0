"""`llmgw restart`: the queue of restart jobs, and each pass's steps (from the pure
`llmgw.restarts.plan`) turned into starts and stops."""

from llmgw import audit, log
from llmgw import restarts as rolling
from llmgw.errors import Conflict, NotFound
from llmgw.reconciler import ReplicaView
from llmgw.states import LIVE, ShardState
from llmgw.store import drop_connection
from llmgw_scheduler.commands import Commands
from llmgw_scheduler.inventory import Inventory
from llmgw_scheduler.models import Catalog
from llmgw_scheduler.needs import Needs

_log = log.get("llmgw.scheduler")


class Restarts:
    def __init__(self, inv: Inventory, catalog: Catalog, needs: Needs, commands: Commands,
                 node_views, cfg, flags, clock):  # fmt: skip
        self.inv = inv
        self.catalog = catalog
        self.needs = needs
        self.commands = commands
        self.node_views = node_views
        self.cfg = cfg  # the scheduler section: start_timeout_s, restart_deadline_s
        self.flags = flags
        self.clock = clock
        # Active ones in queue order, then the most recent that ended.
        self.jobs: list[rolling.Restart] = []

    def restart(self, ids: list[str], now: float, max_surge: int = 1, max_unavailable: int = 1,
                in_place: bool = False) -> list[rolling.Restart]:  # fmt: skip
        """Queue restarts of replicas `ids`; NotFound names the first unknown one. A
        replica already queued or being replaced keeps its restart."""
        for rid in ids:
            r = self.inv.replicas.get(rid)
            if r is None or r.state not in LIVE:
                raise NotFound(
                    f"no running replica '{rid}' (see `llmgw replicas`)", "replica_not_found"
                )
            m = self.catalog.models.get(r.model)
            if m is not None and m.split:
                raise Conflict(
                    f"replica '{rid}' spans nodes: restarting one is not supported yet;"
                    " drain a node it is on and it is replaced whole", "split_replica"
                )  # fmt: skip
        active = {job.replica: job for job in self.jobs if job.active}
        out = []
        for rid in ids:
            job = active.get(rid)
            if job is None:
                r = self.inv.replicas[rid]
                job = rolling.Restart(rid, r.model, r.node, now, max_surge, max_unavailable,
                                      in_place)  # fmt: skip
                self.jobs.insert(sum(1 for j in self.jobs if j.active), job)
                _log.info("restart_queued", replica=rid, model=r.model, node=r.node,
                          max_surge=max_surge, max_unavailable=max_unavailable,
                          in_place=in_place)  # fmt: skip
            out.append(job)
        self.flags.wake = True
        return out

    def state_of(self, replica: str) -> str | None:
        """'queued' or 'replacing' while a restart of `replica` is under way."""
        for job in self.jobs:
            if job.replica == replica and job.active:
                return job.state
        return None

    def drop_active(self) -> None:
        """Leadership changed: the new leader does not carry on the old one's restarts."""
        dropped = [j.replica for j in self.jobs if j.active]
        self.jobs = [j for j in self.jobs if not j.active]
        if dropped:
            _log.warning("restarts_dropped", replicas=",".join(dropped),
                         why="leadership changed; run llmgw restart again")  # fmt: skip

    def counted(self, views: list[ReplicaView]) -> list[ReplicaView]:
        """The reconciler's replicas while restarts run: one being replaced beside itself
        does not count (its replacement does), and one being replaced in place still
        does until it is gone, so nothing else is started."""
        if not self.jobs:
            return views
        surging = {j.replica for j in self.jobs if j.state == rolling.REPLACING}
        views = [v for v in views if v.id not in surging]
        for job in self.jobs:
            old = self.inv.replicas.get(job.replica)
            if job.state == rolling.REPLACING and job.how == rolling.IN_PLACE and old:
                views.append(ReplicaView(old.id, old.model, old.node, ShardState.PENDING,
                                         old.since))  # fmt: skip
        return views

    def pass_(self, now: float) -> None:
        active = [j for j in self.jobs if j.active]
        if not active:
            return
        replicas = {
            r.id: ReplicaView(r.id, r.model, r.node, r.state, r.since)
            for r in self.inv.replicas.values()
        }
        needs = {m.name: self.needs.need(m) for m in self.catalog.models.values()}
        # A replica of another than its model's first profile is replaced by one of its
        # own profile, and holds what that needs.
        own = {}
        for r in self.inv.replicas.values():
            m = self.catalog.models.get(r.model)
            if m is not None and m.profiles and (at := self.catalog.of_replica(r)) is not None:
                if at.profile_name != m.profile_name:
                    own[r.id] = self.needs.need(at)
        # What node_views() counts each replica as taking: its need, or more if it grew.
        holds = {
            r.id: max((own.get(r.id) or needs[r.model]).memory, r.rss)
            for r in self.inv.replicas.values()
            if r.model in needs
        }
        steps = rolling.plan(
            active,
            replicas,
            self.node_views(),
            needs,
            now,
            # Beyond the replacement's own start timeout: stopping the old one comes first.
            2 * self.cfg.start_timeout_s,
            holds,
            deadline_s=self.cfg.restart_deadline_s,
            own=own,
        )
        for job, node in steps.surge:
            old = self.inv.replicas.get(job.replica)
            m = self.catalog.of_replica(old) if old is not None else None
            m = m or self.catalog.models[job.model]
            job.replacement = self.commands.start(m, node, now) or ""
            _log.info("restart_replacing", replica=job.replica, model=job.model,
                      replacement=job.replacement, node=node, how=job.how)  # fmt: skip
        for job in steps.stop_now:
            _log.info("restart_replacing", replica=job.replica, model=job.model,
                      node=job.node, how=job.how)  # fmt: skip
            self.commands.stop(job.replica, now)
        for job in steps.retire:
            self.commands.stop(job.replica, now)
        for job in steps.ended:
            if job.state == rolling.DONE:
                _log.info("restart_done", replica=job.replica, model=job.model, how=job.how,
                          outcome=job.reason)  # fmt: skip
            else:
                _log.warning("restart_given_up", replica=job.replica, model=job.model,
                             reason=job.reason)  # fmt: skip
                self._audit("restart.given_up", job.replica, model=job.model,
                            reason=job.reason)  # fmt: skip
        if steps.ended:
            active = [j for j in self.jobs if j.active]
            ended = [j for j in self.jobs if not j.active][-rolling.KEEP_ENDED :]
            self.jobs = active + ended

    def _audit(self, action: str, target: str, **detail) -> None:
        """What the scheduler decided on an operator's behalf, beside their changes in the
        audit log (actor `scheduler`); a store that cannot take it leaves the log line."""
        try:
            audit.record(action, "scheduler", "", target, now=self.clock(), **detail)
        except Exception as e:
            _log.error("audit_write_failed", action=action, target=target, reason=str(e)[:200])
            drop_connection()
