"""What the scheduler tells agents: the outbox the loop sends from, the start intents
kept in the store, and the start, stop, install and log requests themselves."""

import json
import secrets
import threading
from collections.abc import Callable

from llmgw import apikeys, bus, log, mirror
from llmgw.catalog import Model
from llmgw.states import MsgType, ShardState
from llmgw.store import MirroredWeights, ReplicaIntent, drop_connection
from llmgw_scheduler.inventory import Inventory, Replica

_log = log.get("llmgw.scheduler")
WORKER = "rpc-worker"  # a start_shard's role: a gang's worker (tools/agentd/workers.py)


class Outbox(list):
    """(node, message) pairs to send, stamped with our epoch; the loop sends and clears."""

    def __init__(self, role):
        super().__init__()
        self.role = role  # .epoch: ours while we lead

    def send(self, node: str, kind: str, body: dict) -> None:
        self.append((node, bus.encode(kind, "scheduler", body, self.role.epoch)))


class Intents:
    """Replica ids with a start intent in the store: a leader that takes over counts them
    as pending, so it does not start them again."""

    def __init__(self):
        self.ids: set[str] = set()
        self.done: set[str] = set()  # reported by their agent: delete the intent

    def reported(self, rid) -> None:
        if rid in self.ids:
            self.done.add(rid)

    def take_done(self) -> set[str]:
        """The intents whose replicas an agent has reported: done with, to delete."""
        done = self.done & self.ids
        self.done.clear()
        return done

    @staticmethod
    def delete(ids: set[str]) -> bool:
        """Delete intents from the store; False if it is down (try again later)."""
        try:
            ReplicaIntent.delete().where(ReplicaIntent.id.in_(list(ids))).execute()
            return True
        except Exception as e:
            _log.debug("intents_not_deleted", reason=str(e)[:200])
            drop_connection()
            return False

    def reload(self, inv: Inventory, now: float, start_timeout_s: float) -> None:
        """Read the last leader's intents: one not reported yet counts as pending, so it
        is not started again; the start timeout removes it if it never comes."""
        for row in ReplicaIntent.select():
            self.ids.add(row.id)
            if now - row.created_at > start_timeout_s:
                self.done.add(row.id)  # long settled one way or the other
            elif row.id not in inv.replicas:
                # Its GPUs stay booked: the agent may be loading it on them right now.
                gpus = tuple(g for g in (row.gpus or "").split(",") if g)
                inv.add(Replica(row.id, row.model, row.node, row.profile, ShardState.PENDING,
                                now, gpus=gpus, profile_name=row.profile_name or ""))  # fmt: skip


class Commands:
    """Start, stop and install, each as the inventory and the outbox must see it."""

    def __init__(self, inv: Inventory, outbox: Outbox, intents: Intents, flags,
                 cluster_secret: str, clock):  # fmt: skip
        self.inv = inv
        self.outbox = outbox
        self.intents = intents
        self.flags = flags
        self.cluster_secret = cluster_secret
        self.clock = clock
        self._installs_asked: dict[tuple[str, str], float] = {}
        # Where agents fetch mirrored weights: this scheduler's admin API (empty: none).
        self.mirror_url = ""
        self._mirrored: dict = {}  # replica id -> its MirroredWeights row, until started
        # (model, node) -> the UUIDs of the GPUs a replica of it would be assigned there
        # now (() for a CPU model, None if too few can be taken): views.Views.assign_gpus.
        self.assign: Callable[[Model, str], tuple[str, ...] | None] = lambda m, node: ()

    def start(self, m: Model, node: str, now: float, hold: bool = False,
              memory: int = -1) -> str | None:  # fmt: skip
        """Start a replica of `m` at its profile (Model.at: the one placement chose): the
        intent goes to the store first, with the profile's name, so a leader that takes
        over knows it may be on its way; None if the store would not take it. `hold`: a
        gang's leader, recorded and booked now, started by `start_leader` once its
        workers are ready.

        A GPU replica is assigned its GPUs here, from what the node reported and every
        assignment still held on it; they are written with the intent and booked until
        the replica has stopped. None if too few GPUs can be taken (placement saw them
        free: the node's report changed since)."""
        gpus: tuple[str, ...] = ()
        if not hold:  # a gang's GPUs are its engine's to share out (not assigned yet)
            got = self.assign(m, node)
            if got is None:
                _log.warning("no_gpus_to_assign", model=m.name, node=node)
                return None
            gpus = got
        rid = "r-" + secrets.token_hex(4)
        try:
            epoch = self.outbox.role.epoch
            ReplicaIntent.insert(id=rid, model=m.name, node=node, profile=m.profile_hash(),
                                 epoch=epoch, created_at=now, gpus=",".join(gpus),
                                 profile_name=m.profile_name).execute()  # fmt: skip
            mirrored = MirroredWeights.get_or_none(MirroredWeights.model == m.name)
        except Exception as e:  # the store is down: start nothing we could not record
            _log.warning("intent_not_written", model=m.name, node=node, reason=str(e)[:200])
            drop_connection()
            return None
        self.intents.ids.add(rid)
        key = apikeys.engine_key(self.cluster_secret, rid)
        self.inv.add(Replica(rid, m.name, node, m.profile_hash(), ShardState.PENDING, now,
                             key=key, memory=memory, gpus=gpus,
                             profile_name=m.profile_name))  # fmt: skip
        self._mirrored[rid] = mirrored
        if not hold:
            self.start_leader(m, rid, node)
        return rid

    def model_body(self, m: Model, node: str, mirrored) -> dict:
        """What a shard that loads the model is told of it: its source (from the mirror
        where mirrored), engine and profile."""
        body = {
            "model": m.name, "profile": m.profile_hash(), "profile_name": m.profile_name,
            "engine": m.engine,
            "engine_version": m.engine_version, "source": m.source, "sha256": m.sha256,
            "context": m.context, "parallel": m.parallel, "gpus": m.gpus,
            "args": list(m.args),
        }  # fmt: skip
        if m.kv_cache_gib:
            body["kv_cache_gib"] = m.kv_cache_gib
        if m.max_adapters:
            body["max_adapters"] = m.max_adapters
        if m.pipeline_parallel or m.tensor_parallel:
            body["pipeline_parallel"] = m.pipeline_parallel
            body["tensor_parallel"] = m.tensor_parallel
        if (fetch := self._mirror_body(m, mirrored, node)) is not None:
            body["mirror"] = fetch
        return body

    def start_leader(self, m: Model, rid: str, node: str, workers: list[str] = (),
                     tensor_split: list[float] = (), gang: dict | None = None) -> None:  # fmt: skip
        """Send a replica's start_shard; a gang's leader gets its workers' addresses
        (llama.cpp) or its place in the gang (`gang`: nnodes and rank 0, vLLM)."""
        key = apikeys.engine_key(self.cluster_secret, rid)
        # A gang whose workers load the weights too keeps the row for them (gangs.py).
        mirrored = self._mirrored.get(rid) if gang else self._mirrored.pop(rid, None)
        body = {"id": rid, **self.model_body(m, node, mirrored), "key": key}
        if workers:
            body["rpc"], body["tensor_split"] = list(workers), list(tensor_split)
        if gang:
            body["gang"] = dict(gang)
        r = self.inv.replicas.get(rid)
        gpus = list(r.gpus) if r is not None else []
        if gpus:
            body["gpus_assigned"] = gpus  # the agent sets CUDA_VISIBLE_DEVICES to them
        _log.info("start_replica", replica=rid, model=m.name, node=node,
                  workers=len(workers) or None, gpus=",".join(gpus) or None)  # fmt: skip
        self.outbox.send(node, MsgType.START_SHARD, body)

    def _mirror_body(self, m: Model, mirrored, node: str) -> dict | None:
        """Where `node` fetches `m`'s files from the mirror, or None (not mirrored)."""
        if not self.mirror_url or mirrored is None or mirrored.source != m.source:
            return None
        # The agent fetches these files from the mirror first, proving who it is with
        # a token only the scheduler and that node know (this message is encrypted).
        return {
            "url": self.mirror_url, "node": node, "sha256": mirrored.sha256,
            "token": mirror.node_token(self.cluster_secret, node),
            "files": json.loads(mirrored.files),
        }  # fmt: skip

    def mirror_of(self, m: Model, node: str) -> dict | None:
        """An adapter's `mirror` for `node` (a store read: None if the store is down)."""
        if not self.mirror_url:
            return None
        try:
            mirrored = MirroredWeights.get_or_none(MirroredWeights.model == m.name)
        except Exception as e:
            _log.debug("mirror_not_read", model=m.name, reason=str(e)[:200])
            drop_connection()
            return None
        return self._mirror_body(m, mirrored, node)

    def start_worker(self, m: Model, wid: str, node: str, memory: int, now: float,
                     send: bool = True) -> None:  # fmt: skip
        """Record one worker of a gang (holding `memory` of the model on `node`) and, with
        `send`, start it now (llama.cpp's rpc-server); else `send_worker` does later."""
        self.inv.add_worker(Replica(wid, m.name, node, m.profile_hash(), ShardState.PENDING,
                                    now, role=WORKER, memory=memory))  # fmt: skip
        if send:
            self.send_worker(m, wid, node, memory)

    def send_worker(self, m: Model, wid: str, node: str, memory: int,
                    gang: dict | None = None) -> None:  # fmt: skip
        """A worker's start_shard. With `gang` (nnodes, rank, the leader's master
        ADDR:PORT) it loads its own part of the weights, given as the leader's are."""
        body = {"id": wid, "model": m.name, "profile": m.profile_hash(), "role": WORKER,
                "engine": m.engine, "engine_version": m.engine_version}  # fmt: skip
        if gang:
            mirrored = self._mirrored.get(wid.rpartition(".w")[0])
            body = {**self.model_body(m, node, mirrored), **body, "gang": dict(gang)}
        _log.info("start_worker", worker=wid, model=m.name, node=node, memory=memory)
        self.outbox.send(node, MsgType.START_SHARD, body)

    def stop_worker(self, wid: str, now: float) -> None:
        w = self.inv.workers.get(wid)
        if w is None or w.state == ShardState.STOPPING:
            return
        _log.info("stop_worker", worker=wid, node=w.node, state=w.state)
        self.inv.set_state(w, ShardState.STOPPING, now)
        self.outbox.send(w.node, MsgType.STOP_SHARD, {"id": wid})

    def install(self, node: str, m: Model) -> None:
        key = (node, m.engine_id)
        now = self.clock()
        if now - self._installs_asked.get(key, -1e9) < 60:
            return
        self._installs_asked[key] = now
        _log.info("install_engine", node=node, engine=m.engine_id)
        self.outbox.send(node, MsgType.INSTALL_ENGINE,
                         {"engine": m.engine, "version": m.engine_version})  # fmt: skip

    def stop(self, rid: str, now: float) -> None:
        r = self.inv.replicas.get(rid)
        if r is None:
            return
        _log.info("stop_replica", replica=rid, model=r.model, node=r.node, state=r.state)
        self.inv.set_state(r, ShardState.STOPPING, now)
        self.flags.routes_dirty = True
        self.outbox.send(r.node, MsgType.STOP_SHARD, {"id": rid})


class LogRequests(dict):
    """`llmgw logs`: request id -> {"done": Event, "reply"}, answered by the agent."""

    def __init__(self, outbox: Outbox):
        super().__init__()
        self.outbox = outbox

    def ask(self, node: str, shard: str, lines: int) -> dict:
        """Queue a get_logs; the admin API waits on the returned entry's event."""
        request = secrets.token_hex(8)
        entry = {"done": threading.Event(), "reply": None, "request": request}
        self[request] = entry
        self.outbox.send(node, MsgType.GET_LOGS, {"id": shard, "lines": lines, "request": request})
        return entry

    def answer(self, body: dict) -> None:
        waiter = self.get(body.get("request", ""))
        if waiter is not None:
            waiter["reply"] = body
            waiter["done"].set()
