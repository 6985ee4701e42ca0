"""GPU assignment on the shapes of real machines: the recorded `nvidia-smi` outputs of
tests/fixtures/topology/ (one L4; two L40S over PCIe; 8×H100 SXM on NVSwitch with one
card reporting uncorrectable ECC errors and one a row remap pending; two A100s over
NVLink with one in MIG mode), read by the agent's own Probe and Resources, reported to
the real scheduler in process, placed, explained and restarted."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmgw.config import AgentConfig
from llmgw_agentd.resources import Resources
from llmgw_agentd.topology import Probe
from llmgw_scheduler.fleet_api import View
from tests import fake_smi
from tests.fake_fleet import Fleet, GiB, model

MIG = "in MIG mode (llmgw assigns whole GPUs only)"


@dataclass(frozen=True)
class Shape:
    box: str  # the fixture pair: X.topo.txt and X.health.csv
    gpus: int
    links: set[str]  # the link classes between its GPUs
    usable: tuple[int, ...]  # indices a replica may be given (8 GiB each)
    left_out: dict[int, str] = field(default_factory=dict)  # index -> why never

    def __str__(self) -> str:
        return self.box


SHAPES = [
    Shape("single-gpu", 1, set(), (0,)),
    Shape("pcie-2gpu", 2, {"NODE"}, (0, 1)),
    Shape("h100-sxm-8gpu", 8, {"NV18"}, (0, 1, 2, 3, 4, 7), {
        5: "unhealthy: 2 uncorrectable ECC errors",
        6: "unhealthy: row remapping pending (needs a GPU reset)",
    }),
    Shape("a100-nvlink-pair", 2, {"NV12"}, (0,), {1: MIG}),
]  # fmt: skip


def uuid(box: str, index: int) -> str:
    """The UUID the recording gives GPU `index` (read from the CSV, not by our parser)."""
    (line,) = [ln for ln in fake_smi.recorded(box) if ln.split(", ")[0] == str(index)]
    return line.split(", ")[1]


class Agent:
    """What the agent on node `n` reports of a recorded machine, through its own code."""

    def __init__(self, box: str):
        cfg = AgentConfig()
        self.probe = Probe(cfg, run=fake_smi.runner(box), ib_root=Path("/nonexistent"))
        self.resources = Resources(cfg, probe=self.probe)

    def report(self, fleet: Fleet, kind: str = "heartbeat") -> None:
        fleet.heartbeat("n", gpus=self.resources.snapshot()["gpus"],
                        topology=self.probe.report(), kind=kind)  # fmt: skip


@pytest.fixture
def on(tmp_path):
    """on(box, *models): the scheduler in process, with models, and node `n`'s agent
    reading the recorded `box`, its hello sent."""
    made = []

    def start(box: str, *models) -> tuple[Fleet, Agent]:
        fleet = Fleet(tmp_path, list(models), start_timeout_s=1000.0)
        made.append(fleet)
        agent = Agent(box)
        agent.report(fleet, kind="hello")
        return fleet, agent

    yield start
    for fleet in made:
        fleet.close()


def explain(fleet: Fleet, name: str) -> dict:
    """`llmgw explain-placement NAME --json`, as the admin API builds it."""
    with fleet.sched.lock:
        (node,) = View(fleet.sched).placement(fleet.sched.models[name])["nodes"]
    return node


def starts(fleet: Fleet, state: str = "starting") -> list[dict]:
    """The start_shard bodies of the last pass; each replica then reports `state` (still
    loading, by default) on the GPUs it was assigned."""
    out = [b for _, b in fleet.sent("start_shard")]
    for b in out:
        fleet.shard("n", b["id"], state, gpus=b["gpus_assigned"])
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_agent_reads_the_whole_recorded_machine_and_the_scheduler_gets_it(on, shape, caplog):
    fleet, agent = on(shape.box, model("g", memory=8 * GiB, min_=0, gpus=1))
    report = agent.probe.report()
    assert "probe_failed" not in caplog.text
    assert [g["index"] for g in report["health"]] == list(range(shape.gpus))
    assert report["matrix"]["gpus"] == list(range(shape.gpus))
    assert len(report["matrix"]["links"]) == shape.gpus * (shape.gpus - 1) // 2
    assert set(report["matrix"]["links"].values()) == shape.links
    matrix = fleet.sched.inv.nodes["n"].matrix
    assert matrix is not None and matrix.gpus == list(range(shape.gpus))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_one_gpu_replicas_each_get_a_usable_gpu_of_their_own_while_nvidia_smi_says_all_free(
    on, shape
):
    n = len(shape.usable)
    fleet, agent = on(shape.box, model("g", memory=8 * GiB, min_=n + 1, gpus=1))
    assigned = []
    for _ in range(n + 2):  # one start per model per pass
        fleet.tick()
        assigned += [tuple(b["gpus_assigned"]) for b in starts(fleet)]
        agent.report(fleet)  # the recording again: every GPU as free as before
    # Every replica is still loading: only the bookings keep them apart.
    assert sorted(assigned) == sorted((uuid(shape.box, i),) for i in shape.usable)
    reason = fleet.sched.unplaceable["g"]
    assert f"needs 1 GPU, 0 can be taken (GPU {shape.usable[0]} assigned to r-" in reason
    for i in shape.usable:
        assert f"GPU {i} assigned to r-" in reason
    for i, why in shape.left_out.items():
        assert f"GPU {i} {why}" in reason


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_explain_placement_shows_each_gpu_and_why_one_is_left_out(on, shape):
    fleet, _ = on(shape.box, model("g", memory=8 * GiB, min_=0, gpus=1))
    node = explain(fleet, "g")
    assert node["fits"] is True
    why = {g["index"]: g["why_not"] for g in node["gpus"]}
    assert why == {i: shape.left_out.get(i, "") for i in range(len(why))}
    assert {g["uuid"] for g in node["gpus"]} == {uuid(shape.box, i) for i in why}
    (chosen,) = [g["index"] for g in node["gpus"] if g["assigned"]]
    assert chosen in shape.usable


# box, GPUs per replica, GiB each must have free, the indices it gets (None: none), and
# explain-placement's words: the link that joins them, or why the node cannot take it.
GROUPS = [
    ("single-gpu", 2, 8, None, "needs 2 GPUs, has 1"),
    ("pcie-2gpu", 2, 8, (0, 1), "GPUs 0,1 joined by NODE (pcie)"),
    # GPUs 2 and 3 are busy (10 GiB free); 4-7 share a NUMA node, but 5 and 6 are unusable.
    ("h100-sxm-8gpu", 4, 20, (0, 1, 4, 7), "GPUs 0,1,4,7 joined by NV18 (nvlink)"),
    ("a100-nvlink-pair", 2, 8, None, f"needs 2 GPUs, 1 can be taken (GPU 1 {MIG})"),
]


@pytest.mark.parametrize(("box", "k", "gib", "gets", "says"), GROUPS,
                         ids=[g[0] for g in GROUPS])  # fmt: skip
def test_a_tensor_parallel_replica_gets_the_best_joined_usable_gpus_or_says_why_not(
    on, box, k, gib, gets, says
):
    fleet, agent = on(box, model("tp", memory=gib * GiB, min_=1, gpus=k))
    node = explain(fleet, "tp")
    if gets is None:
        assert (node["fits"], node["reason"], node["gpu_link"]) == (False, says, "")
        fleet.tick()
        assert fleet.sent("start_shard") == []
        assert fleet.sched.unplaceable["tp"] == f"n: {says}"
        return
    assert node["gpu_link"] == says
    assert [g["index"] for g in node["gpus"] if g["assigned"]] == list(gets)
    fleet.tick()
    (start,) = starts(fleet)
    assert start["gpus_assigned"] == [uuid(box, i) for i in gets]
    agent.report(fleet)
    # Loading, on GPUs nvidia-smi still shows free: booked to it all the same.
    booked = {g["index"] for g in explain(fleet, "tp")["gpus"]
              if g["why_not"] == f"assigned to {start['id']}"}  # fmt: skip
    assert booked == set(gets)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_restart_in_place_gives_the_replacement_its_old_gpu_or_a_free_one_not_anothers(on, shape):
    # A replica of another model beside it, where the machine has a second usable GPU.
    beside = 1 if len(shape.usable) > 1 else 0
    fleet, agent = on(shape.box, model("g", memory=8 * GiB, min_=1, gpus=1),
                      model("o", memory=8 * GiB, min_=beside, gpus=1))  # fmt: skip
    held = {}
    for _ in range(2):
        fleet.tick()
        held |= {b["model"]: (b["id"], b["gpus_assigned"]) for b in starts(fleet, "ready")}
        agent.report(fleet)
    (old, old_gpus) = held["g"]
    others = set(held["o"][1]) if beside else set()
    with fleet.sched.lock:
        (job,) = fleet.sched.restart([old], fleet.clock(), in_place=True)
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [old]
    fleet.shard("n", old, "stopping", gpus=old_gpus)
    agent.report(fleet)
    fleet.tick()
    assert fleet.sent("start_shard") == []  # its GPU is still its own until it has stopped
    fleet.shard("n", old, "stopped")
    agent.report(fleet)
    fleet.tick()
    (start,) = starts(fleet, "ready")
    (got,) = start["gpus_assigned"]
    free = {uuid(shape.box, i) for i in shape.usable} - others
    assert got in free and got not in others
    if free == set(old_gpus):  # nothing else free: the old one's GPU, or nothing
        assert [got] == old_gpus
    agent.report(fleet)
    fleet.tick()
    assert job.state == "done", job.reason
