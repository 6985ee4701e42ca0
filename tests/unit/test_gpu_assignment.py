"""GPUs by UUID: placement picks distinct cards, never one assigned to a replica still
loading or one its agent reports unhealthy, prefers NVLink for a tensor-parallel group,
and the scheduler sends the UUIDs and keeps them booked until the replica has stopped."""

import pytest

from llmgw.placement import (
    Fleet,
    Gpu,
    Need,
    NodeView,
    gpus_of,
    pick_gpus,
    place,
    why_not,
)
from llmgw.topology import Topology
from tests.fake_fleet import Fleet as FakeFleet
from tests.fake_fleet import GiB, model

VLLM = "vllm-0.6.3"
LLAMA = "llama.cpp-0.3.36"


def gpu_need(model="g", gib=20, k=1) -> Need:
    return Need(model, gib * GiB, k, VLLM)


def gpu_node(id="n", *gpus: Gpu, topology=None) -> NodeView:
    return NodeView(id, memory_free=64 * GiB, gpus=tuple(gpus), engines={VLLM: "installed"},
                    topology=topology)  # fmt: skip


# -- placement (pure) ----------------------------------------------------------------


def test_two_replicas_placed_in_one_pass_get_different_gpus():
    fleet = Fleet([gpu_node("n", *gpus_of(40 * GiB, 40 * GiB))])
    first = fleet.take(gpu_need("a"), "n")
    second = fleet.take(gpu_need("b"), "n")
    assert {first.uuids, second.uuids} == {("GPU-0",), ("GPU-1",)}
    assert fleet.place(gpu_need("c")).node is None


def test_a_gpu_assigned_to_a_loading_replica_is_not_chosen_however_free_it_looks():
    node = gpu_node("n", Gpu("GPU-a", 80 * GiB, 0, booked="r-1"), Gpu("GPU-b", 30 * GiB, 1))
    assert pick_gpus(node.gpus, 1, 20 * GiB).uuids == ("GPU-b",)
    assert place(gpu_need(gib=40), [node]).reasons == {
        "n": "needs 1 GPU with 40 GiB free, has 0"}  # fmt: skip
    full = gpu_node("n", Gpu("GPU-a", 80 * GiB, 0, booked="r-1"),
                    Gpu("GPU-b", 80 * GiB, 1, booked="r-2"))  # fmt: skip
    assert why_not(gpu_need(), full) == (
        "needs 1 GPU, 0 can be taken (GPU 0 assigned to r-1; GPU 1 assigned to r-2)"
    )


def test_an_unhealthy_or_mig_gpu_is_never_placed_on_and_says_why():
    ecc = "2 uncorrectable ECC errors"
    sick = Gpu.from_report({"index": 0, "uuid": "GPU-s", "memory_free": 80 * GiB,
                            "healthy": False, "health": ecc}, {})  # fmt: skip
    mig = Gpu.from_report({"index": 1, "uuid": "GPU-m", "memory_free": 80 * GiB,
                           "healthy": True, "mig": "Enabled"}, {})  # fmt: skip
    well = Gpu.from_report({"index": 2, "uuid": "GPU-w", "memory_free": 30 * GiB,
                            "healthy": True, "health": "", "mig": "Disabled"}, {})  # fmt: skip
    node = gpu_node("n", sick, mig, well)
    assert pick_gpus(node.gpus, 1, 20 * GiB).uuids == ("GPU-w",)
    p = place(gpu_need(k=2), [node])
    assert p.node is None
    assert p.reasons["n"] == (
        "needs 2 GPUs, 1 can be taken (GPU 0 unhealthy: 2 uncorrectable ECC errors; "
        "GPU 1 in MIG mode (llmgw assigns whole GPUs only))"
    )


def test_a_gpu_an_older_agent_reports_without_health_counts_as_healthy():
    old = Gpu.from_report({"index": 3, "memory_free": 8 * GiB}, {})
    assert (old.uuid, old.why_not, old.free) == ("3", "", 8 * GiB)


def test_one_gpu_goes_to_the_fullest_card_that_fits_keeping_big_ones_free():
    node = gpu_node("n", *gpus_of(80 * GiB, 24 * GiB, 40 * GiB))
    pick = pick_gpus(node.gpus, 1, 20 * GiB)
    assert pick.uuids == ("GPU-1",)
    assert pick.why == "GPU 1, the fullest that fits (24 GiB free)"


PAIRS = Topology(
    gpus=[0, 1, 2, 3],
    links={(0, 1): "PIX", (0, 2): "SYS", (0, 3): "SYS", (1, 2): "SYS", (1, 3): "SYS",
           (2, 3): "NV4"},
)  # fmt: skip


def test_a_tensor_parallel_group_takes_the_gpus_joined_by_nvlink():
    node = gpu_node("n", *gpus_of(40 * GiB, 40 * GiB, 80 * GiB, 80 * GiB), topology=PAIRS)
    fleet = Fleet([node])
    pick = fleet.take(gpu_need(k=2), "n")
    assert pick.uuids == ("GPU-2", "GPU-3")
    assert pick.why == "GPUs 2,3 joined by NV4 (nvlink)"
    # The next group gets what is left: the PCIe pair.
    assert fleet.take(gpu_need("h", k=2), "n").why == "GPUs 0,1 joined by PIX (pcie)"


def test_a_tensor_parallel_group_skips_an_assigned_nvlink_gpu_for_the_best_pcie_set():
    gpus = list(gpus_of(40 * GiB, 40 * GiB, 80 * GiB, 80 * GiB))
    gpus[3] = Gpu("GPU-3", 80 * GiB, 3, booked="r-9")
    pick = pick_gpus(gpus, 2, 20 * GiB, PAIRS)
    assert pick.uuids == ("GPU-0", "GPU-1") and "PIX" in pick.why


def test_without_a_topology_matrix_a_group_takes_the_fullest_gpus_that_fit():
    pick = pick_gpus(gpus_of(80 * GiB, 24 * GiB, 30 * GiB, 10 * GiB), 2, 20 * GiB)
    assert pick.uuids == ("GPU-1", "GPU-2")
    assert pick.why == "GPUs 1,2, the fullest that fit (no topology matrix reported)"


def test_a_pass_never_assigns_one_gpu_twice():
    fleet = Fleet([gpu_node(f"n{i}", *gpus_of(*[40 * GiB] * 4)) for i in range(3)])
    taken = []
    for i in range(8):
        need = gpu_need(f"m{i}", k=i % 2 + 1)
        p = fleet.place(need)
        assert p.node is not None
        taken += [(p.node, u) for u in fleet.take(need, p.node).uuids]
    assert len(taken) == len(set(taken)) == 12
    assert fleet.place(gpu_need("more")).node is None


# -- the scheduler: assigned at the start, sent, booked until stopped ------------------


def two_gpus(free=(40 * GiB, 40 * GiB), healthy=(True, True)) -> list[dict]:
    ecc = "2 uncorrectable ECC errors"
    return [{"index": i, "uuid": f"GPU-{i}{i}", "name": "A100", "memory_total": 80 * GiB,
             "memory_free": f, "healthy": h, "health": "" if h else ecc, "mig": "Disabled"}
            for i, (f, h) in enumerate(zip(free, healthy, strict=True))]  # fmt: skip


@pytest.fixture
def fleet(tmp_path):
    f = FakeFleet(tmp_path, [model("g", memory=20 * GiB, min_=3, max_=3, gpus=1)])
    yield f
    f.close()


def test_a_second_gpu_replica_started_while_the_first_loads_gets_the_other_gpu(fleet):
    fleet.heartbeat("n", gpus=two_gpus())
    starts = []
    for _ in range(3):  # one start per model per pass; nothing reported meanwhile
        fleet.tick()
        starts += [b for _, b in fleet.sent("start_shard")]
        fleet.heartbeat("n", gpus=two_gpus())  # nvidia-smi: both still free
    assert [s["gpus_assigned"] for s in starts] == [["GPU-00"], ["GPU-11"]]
    assert "GPU 0 assigned to" in fleet.sched.unplaceable["g"]


def test_a_replica_keeps_its_gpu_while_stopping_and_frees_it_once_stopped(fleet):
    fleet.heartbeat("n", gpus=two_gpus())
    fleet.tick()
    (start,) = [b for _, b in fleet.sent("start_shard")]
    rid = start["id"]
    fleet.shard("n", rid, "ready", gpus=start["gpus_assigned"])
    with fleet.sched.lock:
        fleet.sched.commands.stop(rid, fleet.clock())
    fleet.tick()
    assert [b["gpus_assigned"] for _, b in fleet.sent("start_shard")] == [["GPU-11"]]
    fleet.tick()
    assert fleet.sent("start_shard") == []  # GPU 0 is still its, stopping
    fleet.shard("n", rid, "stopped")
    fleet.tick()
    assert [b["gpus_assigned"] for _, b in fleet.sent("start_shard")] == [["GPU-00"]]


def test_an_unhealthy_gpu_gets_no_replica(fleet):
    fleet.heartbeat("n", gpus=two_gpus(healthy=(False, True)))
    fleet.tick()
    fleet.tick()
    assert [b["gpus_assigned"] for _, b in fleet.sent("start_shard")] == [["GPU-11"]]
    assert "GPU 0 unhealthy: 2 uncorrectable ECC errors" in fleet.sched.unplaceable["g"]


def test_a_restarted_scheduler_relearns_the_assignment_from_the_agent(tmp_path):
    f = FakeFleet(tmp_path, [model("g", memory=20 * GiB, min_=1, max_=2, gpus=1)])
    try:
        # An engine this scheduler never started, already on GPU 1.
        f.shards["n"] = {"r-old": {"id": "r-old", "model": "g", "state": "ready", "rss": 0,
                                   "endpoint": "http://n:9000", "gpus": ["GPU-11"]}}  # fmt: skip
        # Its GPU has less free than the other: without the booking it would be chosen.
        f.heartbeat("n", gpus=two_gpus(free=(40 * GiB, 30 * GiB)), kind="hello")
        assert f.sched.inv.replicas["r-old"].gpus == ("GPU-11",)
        with f.sched.lock:
            f.sched.commands.start(f.sched.models["g"], "n", f.clock())
        assert [b["gpus_assigned"] for _, b in f.sent("start_shard")] == [["GPU-00"]]
    finally:
        f.close()


def test_a_leader_that_takes_over_keeps_a_pending_replicas_gpus_booked(tmp_path):
    first = FakeFleet(tmp_path, [model("g", memory=20 * GiB, min_=1, max_=1, gpus=1)])
    first.heartbeat("n", gpus=two_gpus())
    first.tick()
    (start,) = [b for _, b in first.sent("start_shard")]
    first.close()
    second = FakeFleet(tmp_path, [model("g", memory=20 * GiB, min_=1, max_=1, gpus=1)])
    try:
        with second.sched.lock:
            second.sched.intents.reload(second.sched.inv, second.clock(), 60.0)
        assert second.sched.inv.replicas[start["id"]].gpus == tuple(start["gpus_assigned"])
    finally:
        second.close()
