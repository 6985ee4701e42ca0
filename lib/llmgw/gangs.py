"""Where a replica that spans several nodes goes: every shard placed, or none.

A model bigger than any one node runs as a gang (docs/multinode.md): an `rpc-server` on
each of its nodes holds a part of the weights, and a leader `llama-server` on one of them
serves HTTP and drives the others over the fabric. The gang is placed whole or not at
all — a replica with one shard missing serves nothing and only holds memory others need.

Pure: node views in, a choice out. The nodes of one gang share an `agent.fabric` label
(and report an `agent.fabric_address`): nodes on different fabrics are not expected to
reach each other there. Within a fabric the gang takes the nodes with the most free
memory, as few as it can (`nodes = "auto"`) or exactly as many as asked, and the model's
memory is split between them in proportion to their free memory, so a big node takes a
big part and every part fits. Among fabrics, the one needing the fewest nodes wins, then
the one with most free memory, then the label: the same views give the same answer.

Nodes are kept per (fabric, engine) in lists sorted by free memory, so a pass placing a
hundred gangs over a thousand nodes reads a few nodes per gang, not all of them.
"""

from dataclasses import dataclass, field

from sortedcontainers import SortedList

from llmgw.placement import INSTALLED, INSTALLING, Need, NodeView, size

AUTO = 0  # profile.nodes = "auto": as few nodes as it fits on, two at least
MAX_NODES = 64
LEADER, WORKER = "leader", "worker"


@dataclass(frozen=True)
class Shard:
    node: str
    memory: int  # bytes of the model's weights and cache this node's rpc-server holds
    install: bool = False  # the engine must be installed there first


@dataclass(frozen=True)
class Gang:
    """A choice: `shards[0]` is the leader's node (it runs an rpc-server too)."""

    fabric: str = ""
    shards: tuple[Shard, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict)  # node or fabric -> why not

    @property
    def placed(self) -> bool:
        return bool(self.shards)

    @property
    def leader(self) -> str | None:
        return self.shards[0].node if self.shards else None

    def tensor_split(self) -> list[float]:
        """llama-server's --tensor-split: each shard's part of the model, in shard order."""
        total = sum(s.memory for s in self.shards) or 1
        return [round(s.memory / total, 4) for s in self.shards]


def nodes_wanted(value) -> int:
    """profile.nodes as a number: AUTO for "auto"."""
    return AUTO if value == "auto" else int(value)


def split(memory: int, free: list[int]) -> list[int]:
    """`memory` in parts proportional to `free`, each part at most its node's free memory
    when sum(free) >= memory; the parts add up to `memory` exactly."""
    total = sum(free)
    if total <= 0:
        return [0] * len(free)
    parts = [memory * f // total for f in free]
    short = memory - sum(parts)
    for i in sorted(range(len(free)), key=lambda i: -free[i])[:short]:
        parts[i] += 1
    return parts


def why_not(need: Need, node: NodeView, fabric: tuple[str, str]) -> str | None:
    """Why `node` cannot hold a shard of `need` at all; None if it can hold some."""
    label, address = fabric
    if node.lost:
        return "lost"
    if node.draining:
        return "draining"
    if not address:
        return "no agent.fabric_address: a replica across nodes needs one"
    state = node.engines.get(need.engine)
    if state is not None and state not in (INSTALLED, INSTALLING):
        return f"{need.engine} is {state}"
    if state == INSTALLING:
        return f"{need.engine} is installing"
    if node.memory_free <= 0:
        return "no free memory"
    return None


class GangFleet:
    """The nodes a pass may place gangs on, booked as it goes."""

    def __init__(self, nodes: list[NodeView], fabrics: dict[str, tuple[str, str]]):
        """`fabrics`: node id -> (agent.fabric label, agent.fabric_address)."""
        self.nodes = {n.id: n for n in nodes}
        self.fabrics = fabrics
        self.free = {n.id: n.memory_free for n in nodes}
        self._lists: dict[str, dict[str, SortedList]] = {}  # engine -> fabric -> nodes

    def _by_fabric(self, need: Need) -> dict[str, SortedList]:
        lists = self._lists.get(need.engine)
        if lists is None:
            lists = self._lists[need.engine] = {}
            for node in self.nodes.values():
                fabric = self.fabrics.get(node.id, ("", ""))
                if why_not(need, node, fabric) is None:
                    row = lists.setdefault(fabric[0], SortedList())
                    row.add((-self.free[node.id], node.id))
        return lists

    def place(self, need: Need, wanted: int) -> Gang:
        """Place one gang of `wanted` nodes (AUTO: as few as fit, at least two)."""
        if wanted != AUTO and not 2 <= wanted <= MAX_NODES:
            raise ValueError(f"a gang spans 2-{MAX_NODES} nodes, not {wanted}")
        best: tuple | None = None
        for label, row in self._by_fabric(need).items():
            chosen, total = [], 0
            limit = MAX_NODES if wanted == AUTO else wanted
            for neg_free, node in row:
                if len(chosen) == limit or (wanted == AUTO and total >= need.memory
                                            and len(chosen) >= 2):  # fmt: skip
                    break
                chosen.append((node, -neg_free))
                total += -neg_free
            if total < need.memory or len(chosen) < max(2, wanted):
                continue
            rank = (len(chosen), -total, label)
            if best is None or rank < best[0]:
                best = (rank, label, chosen)
        if best is None:
            return Gang(reasons=self.explain(need, wanted))
        _, label, chosen = best
        parts = split(need.memory, [free for _, free in chosen])
        shards = tuple(
            Shard(node, part, install=self.nodes[node].engines.get(need.engine) is None)
            for (node, _), part in zip(chosen, parts, strict=True)
        )
        return Gang(label, shards)

    def take(self, need: Need, gang: Gang) -> None:
        """Book a placed gang's memory, so the pass's next gangs see it gone."""
        lists = self._by_fabric(need)
        for s in gang.shards:
            row = lists.get(gang.fabric)
            if row is not None:
                row.discard((-self.free[s.node], s.node))
            self.free[s.node] -= s.memory
            if row is not None and self.free[s.node] > 0:
                row.add((-self.free[s.node], s.node))
        self._lists = {need.engine: lists}  # another engine's lists: rebuilt when read

    def explain(self, need: Need, wanted: int) -> dict[str, str]:
        """Why each node, and each fabric as a whole, cannot take the gang."""
        out: dict[str, str] = {}
        fabrics: dict[str, list[int]] = {}
        for node in self.nodes.values():
            fabric = self.fabrics.get(node.id, ("", ""))
            why = why_not(need, node, fabric)
            if why is not None:
                out[node.id] = why
            else:
                fabrics.setdefault(fabric[0], []).append(self.free[node.id])
        for label, free in sorted(fabrics.items()):
            name = f"fabric {label!r}" if label else "fabric (no agent.fabric label)"
            n = len(free) if wanted == AUTO else min(wanted, len(free))
            top = sorted(free, reverse=True)[:n]
            count = f"{wanted} nodes" if wanted != AUTO else "its nodes"
            if wanted != AUTO and len(free) < wanted:
                out[name] = f"needs {wanted} nodes, has {len(free)} usable"
            else:
                out[name] = (f"needs {size(need.memory)} over {count},"
                             f" {size(sum(top))} free on {n}")  # fmt: skip
            for node in self.nodes.values():
                if self.fabrics.get(node.id, ("", ""))[0] == label and node.id not in out:
                    out[node.id] = f"{size(self.free[node.id])} free; {out[name]}"
        return out
