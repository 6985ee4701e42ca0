"""What the scheduler knows of nodes and replicas, rebuilt from what agents report.

Agents are the truth about what runs: every heartbeat carries a node's whole state, so
after a scheduler restart the inventory is whole again within one heartbeat, and a
replica the scheduler asked for but no agent reports is known to be missing.
"""

from dataclasses import dataclass, field

from llmgw.states import ENDED, LIVE, LOST, ShardState
from llmgw.topology import Topology, TopologyError


@dataclass
class Node:
    id: str
    last_seen: float
    cpus: int = 0
    memory_total: int = 0
    memory_available: int = 0
    gpus: list = field(default_factory=list)
    # engine id -> {"state", "reason", "accelerators", and for a failed install that is
    # retried "attempts" and "retry_in_s"}, as the agent reports them
    engines: dict = field(default_factory=dict)
    # engine name -> {"accelerators"}: what an install of it on this node would build
    installable: dict = field(default_factory=dict)
    lost: bool = False
    draining: bool = False
    version: str = ""  # the llmgw its agent runs
    disk_total: int = 0  # the agent's state directory's file system (0: not reported)
    disk_free: int = 0
    fetching: list = field(default_factory=list)  # weights on their way from the mirror
    weights: frozenset = frozenset()  # content ids of the weights the node has
    # The GPU interconnect matrix, InfiniBand ports, GPU health and fabric address, as
    # the agent reports them (llmgw_agentd.topology.Probe.report); {} from older agents.
    topology: dict = field(default_factory=dict)
    # Its matrix parsed, for placement's choice of a tensor-parallel group (None: none
    # reported); parsed again only when the report changes.
    matrix: Topology | None = None


@dataclass
class Replica:
    id: str
    model: str
    node: str
    profile: str
    state: str  # a ShardState
    since: float
    endpoint: str = ""
    key: str = field(default="", repr=False)  # the engine's key: never in a repr or a log
    rss: int = 0
    reason: str = ""
    last_used: float = 0.0  # when a router last answered a request with it; 0: never
    # Its node was lost while it ran: whatever becomes of it is the node's doing, not its
    # engine's (cleared once its agent reports it alive again).
    orphaned: bool = False
    # When it was first known (asked for, or first reported): its age. `since` is when
    # its state last changed, so a replica that just began draining looked 0 s old.
    created: float = 0.0
    # A worker of a replica across nodes (Inventory.workers, gangs.py): "rpc-worker".
    role: str = ""
    # Bytes it holds on its node, when not its model's whole need: a worker's part, or a
    # gang's leader (its workers hold the weights). -1: the model's need.
    memory: int = -1
    # The LoRA adapters its engine has loaded, as its agent said (adapters.py).
    adapters: tuple[str, ...] = ()
    # A gang's leader whose workers join it (vLLM): the ADDR:PORT they meet at, once its
    # agent has chosen the port.
    master: str = ""
    # When it last became ready (0: never yet): eviction spares it until it has been
    # ready scheduler.eviction_min_lifetime_s (eviction.py). One first heard of as ready
    # (adopted, or after a scheduler restart) counts from then.
    ready_at: float = 0.0
    # The name of the model's profile it runs, as its start decision or its agent said
    # ("": not said, an older agent's: models.profile_of finds it by `profile`, the hash).
    profile_name: str = ""
    # The UUIDs of the GPUs it is assigned, from the start decision until it has stopped:
    # no other replica is placed on them, however free nvidia-smi says they are.
    gpus: tuple[str, ...] = ()

    @property
    def gang(self) -> str:
        """A worker's leader: worker `r-1a2b.w0` belongs to replica `r-1a2b`."""
        return self.id.rpartition(".w")[0] if self.role else ""

    def __post_init__(self):
        self.created = self.created or self.since


def accelerators(node: Node) -> dict[str, frozenset]:
    """What each engine's build on `node` can use, as placement reads it (NodeView):
    by engine id for those it has, installs or failed to, by name for an install to be."""
    out = {}
    for key, info in (*node.installable.items(), *node.engines.items()):
        got = info.get("accelerators") if isinstance(info, dict) else None
        if isinstance(got, list):
            out[key] = frozenset(str(a) for a in got)
    return out


class Inventory:
    """Nodes and replicas, with replicas indexed by node and by model: node views, model
    states and the routing table are built under the lock on every pass and publish, and
    must not walk every replica for every node or model. Change replicas only through
    these methods, which keep the indexes."""

    def __init__(self):
        self.nodes: dict[str, Node] = {}
        self.replicas: dict[str, Replica] = {}
        self._by_node: dict[str, dict[str, Replica]] = {}
        self._by_model: dict[str, dict[str, Replica]] = {}
        self._lost: set[str] = set()
        # The workers of replicas across nodes (gangs.py), kept apart: they serve nothing
        # and count toward no model, only toward their nodes' memory.
        self.workers: dict[str, Replica] = {}
        self._workers_by_node: dict[str, dict[str, Replica]] = {}
        self.ended_workers: dict[str, str] = {}  # worker -> why, until the next gang pass

    def node_report(self, node_id: str, body: dict, now: float) -> Node:
        """Fold a hello/heartbeat body's resources and engines into the node."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = Node(node_id, now)
        res = body.get("resources") or {}
        node.last_seen = now
        node.lost = False
        self._lost.discard(node_id)
        node.cpus = int(res.get("cpus") or 0)
        node.memory_total = int(res.get("memory_total") or 0)
        node.memory_available = int(res.get("memory_available") or 0)
        node.gpus = list(res.get("gpus") or [])
        node.engines = dict(body.get("engines") or {})
        installable = body.get("installable")
        node.installable = dict(installable) if isinstance(installable, dict) else {}
        node.version = str(body.get("version") or "")
        node.disk_total = int(res.get("disk_total") or 0)
        node.disk_free = int(res.get("disk_free") or 0)
        node.fetching = [f for f in body.get("fetching") or [] if isinstance(f, dict)]
        node.weights = frozenset(str(w) for w in body.get("weights") or [])
        topo = body.get("topology")
        topo = topo if isinstance(topo, dict) else {}
        if topo.get("matrix") != node.topology.get("matrix"):
            try:
                node.matrix = Topology.from_dict(topo["matrix"]) if topo.get("matrix") else None
            except (TopologyError, TypeError, ValueError, AttributeError):
                node.matrix = None  # placement then takes the fullest GPUs that fit
        node.topology = topo
        return node

    def shards_report(self, node_id: str, shards: list[dict], now: float, grace_s: float):
        """Reconcile our replicas on `node_id` with the shards it reports.

        Returns (changed, vanished): whether anything visible changed, and replicas we
        thought were there that the agent no longer has (pending ones get `grace_s`).
        """
        changed = False
        seen = set()
        for shard in shards:
            changed |= self.shard_update(node_id, shard, now)
            seen.add(shard.get("id"))
        vanished = []
        for r in self.on_node(node_id):
            if r.id in seen:
                continue
            if r.state == ShardState.PENDING and now - r.since < grace_s:
                continue
            vanished.append(self.remove(r.id))
            changed = True
        for w in self.workers_on(node_id):  # its gang sees it gone: no replica of its own
            if w.id not in seen and not (w.state == ShardState.PENDING
                                         and now - w.since < grace_s):  # fmt: skip
                self.remove_worker(w.id)
        return changed, vanished

    def shard_update(self, node_id: str, shard: dict, now: float) -> bool:
        """Apply one shard report; True when its state or endpoint changed."""
        rid = shard.get("id")
        if not isinstance(rid, str):
            return False
        state = shard.get("state", "")
        if shard.get("role") or rid in self.workers:
            self._worker_update(node_id, rid, shard, now)
            return False  # serves nothing: the routing table is the same
        r = self.replicas.get(rid)
        if r is None:
            if state not in LIVE:
                return False
            # A replica we did not know: the scheduler restarted, or it was adopted.
            r = Replica(rid, shard.get("model", ""), node_id, shard.get("profile", ""), state, now,
                        profile_name=str(shard.get("profile_name") or ""))  # fmt: skip
            self.add(r)
            changed = True
        else:
            changed = r.state != state or r.endpoint != shard.get("endpoint", r.endpoint)
            if r.state == ShardState.STOPPING and state in LIVE:
                state = ShardState.STOPPING  # we asked it to stop; the report predates that
                changed = False
        if r.state != state:
            r.since = now
        if state == ShardState.READY and (r.state != state or not r.ready_at):
            r.ready_at = now
        if state in LIVE:
            r.orphaned = False
        r.state = state
        r.endpoint = shard.get("endpoint", r.endpoint) or r.endpoint
        r.master = str(shard.get("master") or r.master)
        r.profile_name = str(shard.get("profile_name") or r.profile_name)
        r.rss = int(shard.get("rss") or 0)
        r.reason = shard.get("reason", "") or ""
        if isinstance(shard.get("gpus"), list):  # older agents say nothing: keep ours
            r.gpus = tuple(str(g) for g in shard["gpus"])
        adapters = tuple(str(a) for a in shard.get("adapters") or ())
        changed |= adapters != r.adapters
        r.adapters = adapters
        if state in ENDED:
            self.remove(rid)
        return changed

    def _worker_update(self, node_id: str, wid: str, shard: dict, now: float) -> None:
        state = shard.get("state", "")
        w = self.workers.get(wid)
        if w is None:
            if state not in LIVE:
                return
            w = Replica(wid, shard.get("model", ""), node_id, shard.get("profile", ""), state,
                        now, role=str(shard.get("role") or "rpc-worker"))  # fmt: skip
            self.add_worker(w)
        elif w.state == ShardState.STOPPING and state in LIVE:
            return  # we asked it to stop; the report predates that
        if w.state != state:
            w.since = now
        if state in LIVE:
            w.orphaned = False
        w.state = state
        w.endpoint = shard.get("endpoint", w.endpoint) or w.endpoint
        w.rss = int(shard.get("rss") or 0)
        w.reason = shard.get("reason", "") or ""
        if state in ENDED:
            self.remove_worker(wid)
            self.ended_workers[wid] = w.reason  # for its gang to say why it ended

    def add_worker(self, w: Replica) -> None:
        self.remove_worker(w.id)
        self.workers[w.id] = w
        self._workers_by_node.setdefault(w.node, {})[w.id] = w

    def remove_worker(self, wid: str) -> Replica | None:
        w = self.workers.pop(wid, None)
        if w is not None:
            mine = self._workers_by_node.get(w.node)
            if mine is not None:
                mine.pop(wid, None)
                if not mine:
                    del self._workers_by_node[w.node]
        return w

    def workers_on(self, node_id: str) -> list[Replica]:
        return list(self._workers_by_node.get(node_id, {}).values())

    def mark_lost(self, now: float, lost_after_s: float) -> list[Node]:
        newly = []
        for node in self.nodes.values():
            if not node.lost and now - node.last_seen > lost_after_s:
                node.lost = True
                self._lost.add(node.id)
                newly.append(node)
        for node in newly:
            for r in self.on_node(node.id) + self.workers_on(node.id):
                r.orphaned = True
        return newly

    def forget_node(self, node_id: str) -> list[Replica]:
        """Drop a removed node (`llmgw nodes remove`) with its replicas and workers, as if
        it had never reported: not `lost`, not in any count. Returns its replicas."""
        self.nodes.pop(node_id, None)
        self._lost.discard(node_id)
        gone = [self.remove(r.id) for r in self.on_node(node_id)]
        for w in self.workers_on(node_id):
            self.remove_worker(w.id)
        return [r for r in gone if r is not None]

    def add(self, r: Replica) -> None:
        self.remove(r.id)
        self.replicas[r.id] = r
        self._by_node.setdefault(r.node, {})[r.id] = r
        self._by_model.setdefault(r.model, {})[r.id] = r

    def remove(self, rid: str) -> Replica | None:
        r = self.replicas.pop(rid, None)
        if r is not None:
            for index, key in ((self._by_node, r.node), (self._by_model, r.model)):
                mine = index.get(key)
                if mine is not None:
                    mine.pop(rid, None)
                    if not mine:
                        del index[key]
        return r

    @staticmethod
    def set_state(r: Replica, state: str, now: float) -> None:
        r.state, r.since = state, now

    def on_node(self, node_id: str) -> list[Replica]:
        return list(self._by_node.get(node_id, {}).values())

    def of_model(self, model: str) -> list[Replica]:
        return list(self._by_model.get(model, {}).values())

    def serving(self, model: str, lost: set[str]) -> bool:
        """Whether `model` has a ready replica on a node not in `lost`."""
        return any(r.state == ShardState.READY and r.node not in lost
                   for r in self._by_model.get(model, {}).values())  # fmt: skip

    def lost_nodes(self) -> set[str]:
        return set(self._lost)

    def state_of(self, r: Replica, lost: set[str] | None = None) -> str:
        """What to tell an operator: `lost` for a live replica on a lost node (it counts
        toward nothing, whatever its agent last said), else its reported state."""
        if lost is None:
            lost = self._lost
        return LOST if r.node in lost and r.state in LIVE else r.state
