"""Where a replica of a model goes: which node has the memory, the GPUs and the engine.

Pure: node views in, a choice out. Among the nodes that fit, the choice prefers the
engine already installed, then installing, then not there yet (the last two need an
install first); then the node with the fewest replicas of the same model, so a node's
loss takes few of a model's replicas with it; then the most free memory; ties go to
the node id, so the same views always give the same answer.

For a GPU model, `Need.memory` is what each of its GPUs must have free, and "free
memory" in that ranking means the free memory of the GPUs it would get. GPUs are known
by UUID: one assigned to a replica (from the start decision until the replica has
stopped, however free nvidia-smi says it is while the engine loads) or unusable (its
agent reports it unhealthy, or in MIG mode) is never chosen. Which GPUs a replica gets
on its node is `pick_gpus`: for one GPU the smallest that fits (the big ones stay free
for bigger models); for a tensor-parallel group the set the node's topology matrix
joins best (NVLink before PCIe, llmgw.topology.choose_gpus), else the smallest that fit.

A pass over a thousand nodes must not compare every need with every node: nodes are
kept in lists per engine state, sorted by free memory, so finding the best fit is a walk
past the few nodes that already hold the model. Reason strings are built only when
nothing fits or when asked.
"""

import dataclasses
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from llmgw import engines
from llmgw.topology import Topology, choose_gpus

GiB = 1 << 30
MiB = 1 << 20
INSTALLED, INSTALLING = "installed", "installing"
_TIERS = 3  # installed, installing, absent


@dataclass(frozen=True)
class Need:
    """What one replica of a model needs."""

    model: str
    memory: int  # bytes of host memory; for gpus > 0, bytes free on each of its GPUs
    gpus: int  # 0: runs on CPU
    engine: str  # engine id, e.g. "llama.cpp-0.3.36"
    disk: int = 0  # bytes of weights a node must fetch (0: not known)
    weights: str = ""  # their content id: a node that has them needs no disk
    profile: str = ""  # the model's profile it is the need of ("": its only one)


@dataclass(frozen=True)
class Gpu:
    """One GPU of a node, by its UUID."""

    uuid: str
    free: int  # bytes free, as its agent last read them
    index: int = -1  # nvidia-smi's index: its row in the topology matrix (-1: unknown)
    booked: str = ""  # the replica it is assigned to, until that replica has stopped
    unusable: str = ""  # why it takes no work at all ("unhealthy: 2 uncorrectable ...")

    @property
    def why_not(self) -> str:
        """Empty for a GPU a new replica may take, else why not."""
        return self.unusable or (f"assigned to {self.booked}" if self.booked else "")

    def label(self) -> str:
        return f"GPU {self.index}" if self.index >= 0 else self.uuid

    @classmethod
    def from_report(cls, report: dict, booked: Mapping[str, str]) -> "Gpu":
        """A GPU as its agent reports it in `resources.gpus`, with `booked` (UUID -> the
        replica assigned it). An agent too old to say a UUID is known by the index."""
        index = int(report.get("index", -1))
        uuid = str(report.get("uuid") or index)
        unusable = ""
        if report.get("healthy") is False:
            unusable = f"unhealthy: {report.get('health') or 'its agent says so'}"
        elif str(report.get("mig") or "").lower() == "enabled":
            # CUDA sees a GPU in MIG mode only through its instances, which llmgw does
            # not assign: a replica given the whole card would find no device.
            unusable = "in MIG mode (llmgw assigns whole GPUs only)"
        return cls(uuid, int(report.get("memory_free") or 0), index, booked.get(uuid, ""),
                   unusable)  # fmt: skip


@dataclass(frozen=True)
class GpuPick:
    """The GPUs a replica gets on its node (UUIDs, in nvidia-smi's index order) and a
    sentence for explain-placement saying which and why."""

    uuids: tuple[str, ...]
    why: str


def pick_gpus(gpus: tuple[Gpu, ...] | list[Gpu], k: int, memory: int,
              topo: Topology | None = None) -> GpuPick | None:  # fmt: skip
    """`k` of the GPUs that may be taken and have `memory` bytes free; None if too few."""
    fit = sorted((g for g in gpus if not g.why_not and g.free >= memory),
                 key=lambda g: (g.free, g.index, g.uuid))  # fmt: skip
    if k <= 0 or len(fit) < k:
        return None
    if k == 1:
        g = fit[0]
        return GpuPick((g.uuid,), f"{g.label()}, the fullest that fits ({size(g.free)} free)")
    by_index = {g.index: g for g in fit}
    if topo is not None and topo.gpus and -1 not in by_index and len(by_index) == len(fit):
        choice = choose_gpus(topo, list(by_index), k)
        if choice is not None:
            return GpuPick(tuple(by_index[i].uuid for i in choice.gpus), choice.why)
    chosen = sorted(fit[:k], key=lambda g: (g.index, g.uuid))
    names = ",".join(str(g.index) if g.index >= 0 else g.uuid for g in chosen)
    return GpuPick(tuple(g.uuid for g in chosen),
                   f"GPUs {names}, the fullest that fit (no topology matrix reported)")  # fmt: skip


def gpus_of(*free: int) -> tuple[Gpu, ...]:
    """GPUs 0, 1, … with these bytes free, UUIDs "GPU-0", "GPU-1"… (tests, benchmarks)."""
    return tuple(Gpu(f"GPU-{i}", f, i) for i, f in enumerate(free))


def gpu_words(gpus: tuple[Gpu, ...]) -> str:
    """Why each GPU that cannot be taken cannot: "GPU 1 unhealthy: …; GPU 0 assigned to …"."""
    return "; ".join(f"{g.label()} {g.why_not}" for g in gpus if g.why_not)


@dataclass
class NodeView:
    id: str
    lost: bool = False
    draining: bool = False
    memory_free: int = 0  # bytes available for new replicas
    gpus: tuple[Gpu, ...] = ()  # every GPU it reports, assigned and unusable ones too
    # engine id -> "installed" | "installing" | "failed: <reason>"; absent: installable
    engines: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)  # model -> replicas on this node
    disk_free: int = 0  # bytes free where the agent keeps weights (0: not reported)
    weights: frozenset = frozenset()  # content ids of the weights it has
    topology: Topology | None = None  # its GPU interconnect matrix, if it reported one
    # What each engine's build on this node can use ("cpu", "cuda"), by engine id for one
    # it has or is installing, by engine name for what an install would build; absent:
    # not said (an older agent, a configured command), and nothing is refused for it.
    accelerators: dict[str, frozenset] = field(default_factory=dict)

    @property
    def gpus_free(self) -> tuple[Gpu, ...]:
        """The GPUs a new replica may take."""
        return tuple(g for g in self.gpus if not g.why_not)


def accelerators_on(node: NodeView, engine: str) -> frozenset | None:
    """What engine id `engine`'s build on `node` can use (None: not said)."""
    got = node.accelerators.get(engine)
    return got if got is not None else node.accelerators.get(engine.rpartition("-")[0])


def no_gpu_build(engine: str, node: NodeView) -> bool:
    """The node's build of `engine` is known to use no GPU (llama.cpp built without CUDA):
    a replica given GPUs there would compute on the CPU."""
    got = accelerators_on(node, engine)
    return got is not None and not engines.uses_gpus(got)


def no_gpu_words(engine: str, node: NodeView) -> str:
    name = engine.rpartition("-")[0] or engine
    return f"{name} on this node is built for {engines.built_for(accelerators_on(node, engine))}"


def short_of_disk(need: Need, node: NodeView) -> bool:
    """The node would have to fetch the weights and has not the room for them."""
    return bool(need.disk and node.disk_free and node.disk_free < need.disk
                and need.weights not in node.weights)  # fmt: skip


def disk_words(need: Need, node: NodeView) -> str:
    return f"needs {size(need.disk)} of disk for its weights, {size(node.disk_free)} free"


class Reasons(Mapping):
    """Node id -> why not, worked out when first read: a pass places thousands of needs,
    and formatting every node's reason for each that fits nowhere cost more than the
    placing (10,000 nodes). The figures it reads are the ones at the time of the choice."""

    def __init__(self, explain: Callable[[], dict[str, str]]):
        self._explain = explain
        self._reasons: dict[str, str] | None = None

    def _get(self) -> dict[str, str]:
        if self._reasons is None:
            self._reasons, self._explain = self._explain(), None
        return self._reasons

    def __getitem__(self, node: str) -> str:
        return self._get()[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())


@dataclass(frozen=True)
class Placement:
    node: str | None
    install: bool = False  # the engine must be installed there first
    reasons: Mapping[str, str] = field(default_factory=dict)  # node id -> why not


def gpus_needed(need: Need) -> int:
    """GPUs a replica takes: an engine that only runs on GPUs (vLLM) takes at least one."""
    engine = engines.of(need.engine)
    if engine is not None and engine.needs_gpus:
        return max(need.gpus, 1)
    return need.gpus


def size(n: int) -> str:
    """Bytes as an operator reads them: 2.1 GiB, 40 GiB, 512 MiB."""
    if n >= GiB:
        return f"{n / GiB:.1f}".removesuffix(".0") + " GiB"
    return f"{n // MiB} MiB"


def _engine_words(engine: str) -> str:
    name, _, version = engine.rpartition("-")
    return f"{name} {version}" if name else engine


def why_not(need: Need, node: NodeView) -> str | None:
    """Why a replica of `need` cannot go on `node`, in a few words; None if it can."""
    if node.lost:
        return "lost"
    if node.draining:
        return "draining"
    state = node.engines.get(need.engine)
    if state is not None and state not in (INSTALLED, INSTALLING):
        words = _engine_words(need.engine)
        if state.startswith("failed"):
            reason = state.partition(":")[2].strip() or "no reason given"
            return f"{words} failed to install: {reason}"
        return f"{words} is {state}"
    if short_of_disk(need, node):
        return disk_words(need, node)
    k = gpus_needed(need)
    if k:
        gpus = f"{k} GPU{'s' * (k != 1)}"
        if len(node.gpus) < k:
            return f"needs {gpus}, has {len(node.gpus)}"
        if no_gpu_build(need.engine, node):
            return no_gpu_words(need.engine, node)
        free = node.gpus_free
        if len(free) < k:
            return f"needs {gpus}, {len(free)} can be taken ({gpu_words(node.gpus)})"
        fit = sum(1 for g in free if g.free >= need.memory)
        if fit < k:
            return f"needs {gpus} with {size(need.memory)} free, has {fit}"
        return None
    if node.memory_free < need.memory:
        want, free = size(need.memory), size(node.memory_free)
        if want == free:
            want, free = f"{need.memory / GiB:.2f} GiB", f"{node.memory_free / GiB:.2f} GiB"
        return f"needs {want}, {free} free"
    return None


def _tier(state: str | None) -> int | None:
    if state is None:
        return 2
    if state == INSTALLED:
        return 0
    if state == INSTALLING:
        return 1
    return None


def _kth_largest(gpus: list[Gpu], k: int) -> int:
    return sorted((g.free for g in gpus), reverse=True)[k - 1] if len(gpus) >= k else -1


class _Index:
    """The usable nodes for one engine and GPU count, per engine state, best fit first.

    Each row is a sorted list of ints, not of (free, id) tuples: an entry is
    `-free * width + rank`, the node's rank being its place in id order, so most free
    memory sorts first and ties go to the node id.

    Entries are corrected when a walk meets them, not at every booking: a booking only
    lowers a node's free memory, so a stale entry sorts too early and is always met
    before the walk can stop short of the node's true place. Moving every index's entry
    at every booking, in plain lists, made placing 10,000 needs over 10,000 nodes cost
    0.4 s; most of those moves were in rows that were never read again.
    """

    def __init__(self, fleet: "Fleet", engine: str, k: int):
        self.fleet, self.k = fleet, k
        self.ids, self.width = fleet.ids, fleet.width
        rows: list[list[int]] = [[] for _ in range(_TIERS)]
        self.tier: dict[str, int] = {}  # node id -> its engine state's row
        tiers = {None: 2, INSTALLED: 0, INSTALLING: 1}
        memory, rank, width = fleet.memory, fleet.rank, self.width
        for node in fleet.usable:
            tier = tiers.get(node.engines.get(engine))
            if tier is None or (k and no_gpu_build(engine, node)):
                continue
            key = memory[node.id] if k == 0 else fleet.key(node.id, k)
            if key < 0:
                continue
            self.tier[node.id] = tier
            rows[tier].append(-key * width + rank[node.id])
        self.rows = [SortedList(row) for row in rows]

    def _first(self, row: SortedList, memory: int, counts: dict[str, int],
               skip: frozenset) -> str | None:  # fmt: skip
        """The node with most free memory, at least `memory`, no replica of the model, and
        not in `skip`."""
        ids, width, fleet, k = self.ids, self.width, self.fleet, self.k
        while True:
            for entry in row:
                key = -(entry // width)
                if key < memory:
                    return None
                node = ids[entry % width]
                now = fleet.key(node, k)
                if now != key:  # booked since: move it to its place and walk again
                    row.remove(entry)
                    if now >= 0:
                        row.add(-now * width + entry % width)
                    break
                if not counts.get(node) and node not in skip:
                    return node
            else:
                return None

    def best(self, memory: int, counts: dict[str, int],
             skip: frozenset = frozenset()) -> tuple[str, int] | None:  # fmt: skip
        """(node, tier) of the best fit for `memory`, given replicas of the model per node,
        never one of `skip` (nodes short of disk for this need)."""
        for tier, row in enumerate(self.rows):
            node = self._first(row, memory, counts, skip)
            if node is not None:
                return node, tier
            # Every fitting node already has some: fewest, then most free memory, then id.
            best = None
            for node, c in counts.items():
                if not c or self.tier.get(node) != tier or node in skip:
                    continue
                free = self.fleet.key(node, self.k)
                if free < memory:
                    continue
                rank = (c, -free, node)
                if best is None or rank < best:
                    best = rank
            if best is not None:
                return best[2], tier
        return None


class Fleet:
    """Nodes as a placement pass sees them: `place` chooses, `take` books the resources.

    The views passed in are not changed. `replicas`, if given (model -> node -> count),
    replaces the nodes' own replica counts.
    """

    def __init__(self, nodes: list[NodeView], replicas: dict[str, dict[str, int]] | None = None):
        self.nodes = {n.id: n for n in nodes}
        self.usable = [n for n in nodes if not n.lost and not n.draining]
        self.ids = sorted(self.nodes)  # rank -> node id, for the indexes' int entries
        self.rank = {node: i for i, node in enumerate(self.ids)}
        self.width = max(len(self.ids), 1)
        self.memory = {n.id: n.memory_free for n in self.usable}
        # Per node, the GPUs a replica may still take (its booked and unusable ones left
        # out): each booking replaces the list, so the log below can keep the old one.
        self.gpus: dict[str, list[Gpu]] = {}
        for n in self.usable:
            if free := n.gpus_free:
                self.gpus[n.id] = list(free)
        if replicas is None:
            replicas = {}
            for n in nodes:
                for model, c in n.replicas.items():
                    if c:
                        replicas.setdefault(model, {})[n.id] = c
        self.replicas = replicas
        self._indexes: dict[tuple[str, int], _Index] = {}
        self._reasons: dict[tuple[str, int, int], Reasons] = {}
        # (node, its free memory, its free GPUs) before each booking, so reasons worked out
        # later can see the figures as they were when asked for, without a copy per ask.
        self._log: list[tuple[str, int, list | None]] = []
        # (engine, GPUs needed) -> reasons no booking changes
        self._fixed: dict[tuple[str, int], dict[str, str]] = {}

    def key(self, node: str, k: int) -> int:
        """Free memory a need of k GPUs would see on `node` (-1: not enough GPUs)."""
        if k == 0:
            return self.memory[node]
        return _kth_largest(self.gpus.get(node, []), k)

    def place(self, need: Need, explain: bool = False) -> Placement:
        k = gpus_needed(need)
        ix = self._indexes.get((need.engine, k))
        if ix is None:
            ix = self._indexes[(need.engine, k)] = _Index(self, need.engine, k)
        skip = frozenset()
        if need.disk:  # rare enough (a model with mirrored weights) to look at each node
            skip = frozenset(n.id for n in self.usable if short_of_disk(need, n))
        found = ix.best(need.memory, self.replicas.get(need.model, {}), skip)
        if found is None:
            return Placement(None, reasons=self.reasons(need))
        node, tier = found
        return Placement(node, install=tier > 0, reasons=self.reasons(need) if explain else {})

    def reasons(self, need: Need) -> Reasons:
        """Why not, for every node that cannot take `need` now (worked out when read)."""
        key = (need.engine, need.memory, need.gpus, need.disk, need.weights)
        reasons = self._reasons.get(key)
        if reasons is None:
            at = len(self._log)
            reasons = self._reasons[key] = Reasons(lambda: self._explain(need, *self._at(at)))
        return reasons

    def _at(self, at: int) -> tuple[dict, dict]:
        """Free memory and GPUs per node as they were after the first `at` bookings."""
        memory, gpus = self.memory, self.gpus
        if at < len(self._log):
            memory, gpus = dict(memory), dict(gpus)
            for node, mem, gs in reversed(self._log[at:]):  # the earliest change wins
                memory[node] = mem
                if gs is None:
                    gpus.pop(node, None)
                else:
                    gpus[node] = gs
        return memory, gpus

    def _explain(self, need: Need, memory: dict, gpus: dict) -> dict[str, str]:
        # Called for every need that fits nowhere, so it avoids a full why_not per node:
        # the reasons that no booking can change are kept per engine, the others are
        # formatted straight from the booked figures.
        k = gpus_needed(need)
        out = self._fixed.get((need.engine, k))
        if out is None:
            out = self._fixed[(need.engine, k)] = {}
            for node in self.nodes.values():
                if node.lost or node.draining or _tier(node.engines.get(need.engine)) is None:
                    out[node.id] = why_not(need, node)
                elif k and no_gpu_build(need.engine, node):
                    have = len(node.gpus)
                    out[node.id] = (f"needs {k} GPU{'s' * (k != 1)}, has {have}" if have < k
                                    else no_gpu_words(need.engine, node))  # fmt: skip
        out = dict(out)
        if need.disk:
            for node in self.usable:
                if node.id not in out and short_of_disk(need, node):
                    out[node.id] = disk_words(need, node)
        if k == 0:
            want, sizes = size(need.memory), {}
            for node, free in memory.items():
                if free < need.memory and node not in out:
                    text = sizes.get(free)
                    if text is None:
                        text = sizes[free] = size(free)
                        if text == want:
                            text = sizes[free] = None
                    if text is None:
                        out[node] = why_not(need, _booked(self.nodes[node], memory, gpus))
                    else:
                        out[node] = f"needs {want}, {text} free"
            return out
        no_gpus = f"needs {k} GPU{'s' * (k != 1)}, has 0"
        for node in memory:
            if node in out:
                continue
            if not self.nodes[node].gpus:
                out[node] = no_gpus
            else:
                why = why_not(need, _booked(self.nodes[node], memory, gpus))
                if why is not None:
                    out[node] = why
        return out

    def take(self, need: Need, node: str) -> GpuPick | None:
        """Book one replica of `need` on `node`: its memory or GPUs, and one for spread.
        Returns the GPUs it gets (None for a CPU replica)."""
        k = gpus_needed(need)
        free = self.memory[node]
        self._log.append((node, free, self.gpus.get(node)))
        pick = None
        if k == 0:
            self.memory[node] = free - need.memory
        else:
            gpus = self.gpus.get(node, [])
            pick = pick_gpus(gpus, k, need.memory, self.nodes[node].topology)
            taken = set(pick.uuids) if pick else set()
            self.gpus[node] = [g for g in gpus if g.uuid not in taken]
        counts = self.replicas.setdefault(need.model, {})
        counts[node] = counts.get(node, 0) + 1
        if self._reasons:
            self._reasons.clear()
        return pick


def _booked(node: NodeView, memory: dict, gpus: dict) -> NodeView:
    """`node` with the free memory and GPUs the booking left it."""
    if node.id not in memory:
        return node
    left = {g.uuid for g in gpus.get(node.id, ())}
    taken = tuple(g if g.why_not or g.uuid in left else
                  dataclasses.replace(g, booked="a replica placed in this pass")
                  for g in node.gpus)  # fmt: skip
    if memory[node.id] == node.memory_free and taken == node.gpus:
        return node
    return dataclasses.replace(node, memory_free=memory[node.id], gpus=taken)


def first_fit(fleet: Fleet, needs: Sequence[Need],
              explain: bool = False) -> tuple[Need, Placement]:  # fmt: skip
    """One model's profiles (`needs`, in order) tried: the first that fits a node, with its
    placement. If none does, the first, with each node's reasons for every profile
    ("tp2: needs 2 GPUs, has 1 | cpu: needs 8 GiB, 4 GiB free")."""
    tried = []
    for need in needs:
        p = fleet.place(need, explain)
        if p.node is not None:
            return need, p
        tried.append((need.profile, p.reasons))
    if len(tried) == 1:
        return needs[0], p
    return needs[0], Placement(None, reasons=Reasons(lambda: profile_reasons(tried)))


def profile_reasons(tried: list[tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """Per node, why not for each profile in turn; one reason said once when every
    profile has it ("lost", "draining")."""
    out: dict[str, str] = {}
    nodes = dict.fromkeys(n for _, reasons in tried for n in reasons)
    for node in nodes:
        whys = [(name, reasons.get(node, "fits")) for name, reasons in tried]
        if len({why for _, why in whys}) == 1:
            out[node] = whys[0][1]
        else:
            out[node] = " | ".join(f"{name}: {why}" for name, why in whys)
    return out


def place(need: Need, nodes: list[NodeView], explain: bool = False) -> Placement:
    """The best node for one replica of `need`; reasons for the others if none or `explain`."""
    return Fleet(nodes).place(need, explain)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector held off for one pass (a `with` block or a decorator).

    A pass over 10,000 nodes allocates hundreds of thousands of short-lived ints, tuples
    and placements, and makes no reference cycles; each allocation burst set off a
    collection, and the older generations' walk every node view of the scheduler's heap.
    That was 40% of placing 10,000 needs over 10,000 nodes. Memory is still freed as
    usual by reference counting; only cycles wait until the pass ends.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@collector_paused()
def place_many(needs: list[Need], nodes: list[NodeView]) -> list[Placement]:
    """Place each need in turn, booking each choice before the next is made."""
    fleet = Fleet(nodes)
    out = []
    for need in needs:
        p = fleet.place(need)
        if p.node is not None:
            fleet.take(need, p.node)
        out.append(p)
    return out
