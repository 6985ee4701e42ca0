"""Replicas across nodes (docs/multinode.md): placed, started and ended as gangs.

A gang is a leader — a replica like any other, in the inventory, counted, routed to —
and its workers (`Inventory.workers`): for llama.cpp one rpc-server on each node of the
gang, the leader's own node included; for an engine whose workers join the leader
(`Engine.joins_leader`, vLLM) one headless rank on each node but the leader's. The
pass here:

- places a model with `profile.nodes` other than 1 (the reconciler leaves those alone):
  all shards or none (lib/llmgw/gangs.py), at most one gang per model per pass, with
  the same backoff and parking as any start; a model with `nodes = "auto"` that fits on
  one node gets a plain replica instead;
- starts the workers first and holds the leader (recorded, its memory booked) until
  every worker listens, then starts it with their addresses and parts; or, where the
  workers join the leader, starts the leader first (rank 0, with a port of its node
  for the ranks to meet at) and holds the workers (recorded, booked) until its agent
  reports that ADDR:PORT, then starts each with its rank. Such a gang is ready when
  the leader's health answers, which needs every rank;
- ends the whole gang when any shard fails, vanishes or its node is lost: a replica with
  a part missing serves nothing, so it is stopped and the reconciling places a new one;
- replaces a gang with a shard on a draining node whole: the new gang is placed on other
  nodes, and the old one is stopped once the model has its ready replicas without it
  (or the drain's grace is over);
- after a scheduler restart, takes back the gangs whose leader its agent still reports,
  and stops workers whose leader is gone.
"""

from dataclasses import dataclass, field

from llmgw import engines, log
from llmgw.catalog import Model
from llmgw.gangs import AUTO, GangFleet
from llmgw.placement import Fleet, NodeView
from llmgw.states import ACTIVE, LIVE, ShardState
from llmgw_scheduler.commands import Commands
from llmgw_scheduler.inventory import Inventory

_log = log.get("llmgw.scheduler.gangs")
READY, PENDING = ShardState.READY, ShardState.PENDING


@dataclass
class Job:
    """One gang: its leader's replica id and node, its workers' ids in shard order."""

    leader: str
    model: str
    node: str
    workers: list[str]
    split: list[float] = field(default_factory=list)
    # The held shards' start_shard has gone out: the leader's, or, where the workers
    # join the leader (`joins`), the workers'.
    sent: bool = False
    joins: bool = False


class Gangs:
    def __init__(self, inv: Inventory, commands: Commands, parking, cfg, flags):
        self.inv = inv
        self.commands = commands
        self.parking = parking
        self.cfg = cfg  # the scheduler section: drain_grace_s
        self.flags = flags
        self.jobs: dict[str, Job] = {}

    # -- what runs ----------------------------------------------------------------------

    def leaders(self, model: str, skip_nodes: set[str]) -> list:
        """A split model's replicas that count: active, with no shard on `skip_nodes`
        (lost or draining)."""
        out = []
        for r in self.inv.of_model(model):
            if r.state not in ACTIVE or r.node in skip_nodes:
                continue
            job = self.jobs.get(r.id)
            if job is not None and any(self._node_of(w) in skip_nodes for w in job.workers):
                continue
            out.append(r)
        return out

    def _node_of(self, wid: str) -> str:
        w = self.inv.workers.get(wid)
        return w.node if w is not None else ""

    def shards(self, rid: str) -> list[dict]:
        """A replica's workers as `llmgw replicas` shows them (empty: not a gang)."""
        job = self.jobs.get(rid)
        if job is None:
            return []
        out = []
        for wid in job.workers:
            w = self.inv.workers.get(wid)
            out.append({"id": wid, "node": w.node if w else "", "memory": w.memory if w else 0,
                        "state": w.state if w else "gone",
                        "endpoint": w.endpoint if w else ""})  # fmt: skip
        return out

    # -- the pass -------------------------------------------------------------------------

    def pass_(self, models: dict[str, Model], desired: dict[str, int], parked, backoff,
              views: list[NodeView], fabrics: dict[str, tuple[str, str]], drained,
              needs, now: float) -> dict[str, dict[str, str]]:  # fmt: skip
        """Supervise, replace and place gangs; returns model -> node -> why not, for
        the split models that fit nowhere."""
        lost = self.inv.lost_nodes()
        self._adopt(now)
        self._supervise(models, lost, now)
        self._orphans(now)
        skip = lost | set(drained)
        unplaceable: dict[str, dict[str, str]] = {}
        fleet = gfleet = None
        for name, want in desired.items():
            m = models[name]
            have = self.leaders(name, skip)
            if len(have) > m.max:
                newest = sorted(have, key=lambda r: (r.state == READY, -r.since))
                for r in newest[: len(have) - m.max]:
                    self.commands.stop(r.id, now)
                continue
            self._replace_drained(m, want, skip, drained, now)
            if len(have) >= want or name in parked:
                continue
            b = backoff.get(name)
            if b is not None and b.next_at > now:
                continue
            need = needs.need(m)
            if m.nodes == AUTO:  # one node if one will do
                fleet = fleet or Fleet(views)
                p = fleet.place(need)
                if p.node is not None:
                    if p.install:
                        self.commands.install(p.node, m)
                    else:
                        fleet.take(need, p.node)
                        self.commands.start(m, p.node, now)
                    continue
            gfleet = gfleet or GangFleet(views, fabrics)
            gang = gfleet.place(need, m.nodes)
            if not gang.placed:
                unplaceable[name] = dict(gang.reasons)
                continue
            installs = [s.node for s in gang.shards if s.install]
            for node in installs:
                self.commands.install(node, m)
            if installs:
                continue
            gfleet.take(need, gang)
            self._start(m, gang, now)
        return unplaceable

    def _start(self, m: Model, gang, now: float) -> None:
        engine = engines.get(m.engine)
        if engine is not None and engine.joins_leader:
            self._start_ranks(m, gang, now)
            return
        rid = self.commands.start(m, gang.leader, now, hold=True, memory=0)
        if rid is None:
            return  # the store is down: nothing was started
        workers = [f"{rid}.w{i}" for i in range(len(gang.shards))]
        for wid, shard in zip(workers, gang.shards, strict=True):
            self.commands.start_worker(m, wid, shard.node, shard.memory, now)
        self.jobs[rid] = Job(rid, m.name, gang.leader, workers, gang.tensor_split())
        _log.info("gang_placed", replica=rid, model=m.name, fabric=gang.fabric,
                  nodes=",".join(s.node for s in gang.shards))  # fmt: skip

    def _start_ranks(self, m: Model, gang, now: float) -> None:
        """The leader now, as rank 0 on the first node; a worker per other node, held
        until the leader says where they meet (`_supervise`)."""
        first = gang.shards[0]
        rid = self.commands.start(m, first.node, now, hold=True, memory=first.memory)
        if rid is None:
            return  # the store is down: nothing was started
        workers = [f"{rid}.w{rank}" for rank in range(1, len(gang.shards))]
        for wid, shard in zip(workers, gang.shards[1:], strict=True):
            self.commands.start_worker(m, wid, shard.node, shard.memory, now, send=False)
        self.commands.start_leader(m, rid, first.node, gang={"nnodes": len(gang.shards),
                                                             "rank": 0})  # fmt: skip
        self.jobs[rid] = Job(rid, m.name, first.node, workers, joins=True)
        _log.info("gang_placed", replica=rid, model=m.name, fabric=gang.fabric,
                  nodes=",".join(s.node for s in gang.shards))  # fmt: skip

    def _send_ranks(self, m: Model, job: Job, master: str) -> None:
        nnodes = len(job.workers) + 1
        for rank, wid in enumerate(job.workers, start=1):
            w = self.inv.workers[wid]
            gang = {"nnodes": nnodes, "rank": rank, "master": master}
            self.commands.send_worker(m, wid, w.node, w.memory, gang=gang)
        job.sent = True
        self.commands._mirrored.pop(job.leader, None)

    def _supervise(self, models: dict[str, Model], lost: set[str], now: float) -> None:
        for job in list(self.jobs.values()):
            leader = self.inv.replicas.get(job.leader)
            if leader is None or leader.state not in LIVE:
                self._end(job, now)  # the leader ended (stopped, failed, timed out)
                continue
            workers = [self.inv.workers.get(w) for w in job.workers]
            pairs = zip(job.workers, workers, strict=True)
            broken = next(
                (wid for wid, w in pairs if w is None or w.state not in LIVE or w.node in lost),
                None,
            )
            if broken is not None:
                w = self.inv.workers.get(broken)
                gone_with_node = w is not None and (w.node in lost or w.orphaned)
                why = (w.reason if w is not None and w.reason
                       else self.inv.ended_workers.get(broken) or "worker gone")[:300]  # fmt: skip
                _log.warning("gang_broken", replica=job.leader, model=job.model,
                             worker=broken, reason=why.splitlines()[0] if why else "")  # fmt: skip
                self.commands.stop(job.leader, now)
                self._end(job, now)
                self.parking.failed(job.model, now, f"worker {broken}: {why}",
                                    counts=not gone_with_node)  # fmt: skip
                continue
            if job.joins and not job.sent:
                m = models.get(job.model)
                if m is None:
                    self.commands.stop(job.leader, now)
                    self._end(job, now)
                elif leader.master:
                    self._send_ranks(m, job, leader.master)
                continue
            if not job.sent and all(w.state == READY for w in workers):
                m = models.get(job.model)
                if m is None:
                    self.commands.stop(job.leader, now)
                    self._end(job, now)
                    continue
                self.commands.start_leader(m, job.leader, job.node,
                                           [w.endpoint for w in workers], job.split)  # fmt: skip
                job.sent = True
        self.inv.ended_workers.clear()

    def _end(self, job: Job, now: float) -> None:
        for wid in job.workers:
            self.commands.stop_worker(wid, now)
        self.jobs.pop(job.leader, None)
        self.commands._mirrored.pop(job.leader, None)

    def _replace_drained(self, m: Model, want: int, skip: set[str], drained, now) -> None:
        """Stop a gang touching a draining node once the model has `want` ready gangs
        elsewhere, or the drain's grace is over."""
        old = [j for j in self.jobs.values() if j.model == m.name
               and any(n in drained for n in self._nodes(j))]  # fmt: skip
        if not old:
            return
        ready_elsewhere = sum(1 for r in self.leaders(m.name, skip) if r.state == READY)
        for job in old:
            overdue = any(n in drained and now - drained[n] >= self.cfg.drain_grace_s
                          for n in self._nodes(job))  # fmt: skip
            if ready_elsewhere >= want or overdue:
                _log.info("gang_drained", replica=job.leader, model=m.name)
                self.commands.stop(job.leader, now)
                self._end(job, now)

    def _nodes(self, job: Job) -> list[str]:
        return [job.node, *(self._node_of(w) for w in job.workers)]

    def _adopt(self, now: float) -> None:
        """Gangs a scheduler restart forgot: a leader its agent reports as started, with
        workers reported under its id, is a gang again."""
        by_gang: dict[str, list[str]] = {}
        for w in self.inv.workers.values():
            if w.gang not in self.jobs:
                by_gang.setdefault(w.gang, []).append(w.id)
        for rid, wids in by_gang.items():
            leader = self.inv.replicas.get(rid)
            if leader is None or leader.state not in LIVE:
                continue  # _orphans stops its workers
            if leader.state == PENDING:
                # Held by the last scheduler until its workers were ready, and its parts
                # went with it: replaced whole rather than guessed at.
                _log.info("gang_not_resumed", replica=rid, model=leader.model)
                self.commands.stop(rid, now)
                continue
            wids.sort(key=lambda w: int(w.rpartition(".w")[2] or 0))
            self.jobs[rid] = Job(rid, leader.model, leader.node, wids, sent=True)
            _log.info("gang_adopted", replica=rid, model=leader.model, workers=len(wids))

    def _orphans(self, now: float) -> None:
        """Workers whose leader is gone, or was never started by a scheduler alive now."""
        for w in list(self.inv.workers.values()):
            if w.gang in self.jobs or w.state == ShardState.STOPPING:
                continue
            _log.info("worker_orphaned", worker=w.id, node=w.node)
            self.commands.stop_worker(w.id, now)
