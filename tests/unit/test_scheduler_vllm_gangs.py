"""vLLM replicas across nodes through the real scheduler in process: the leader first (rank
0), its workers once it says where they meet, each with its rank and the weights, and
the whole gang ended when any part of it fails."""

import pytest

from tests.fake_fleet import Fleet, GiB, model

NODES = ("a", "b", "c")
ENGINE = "vllm-0.32.0"


def hello(fleet: Fleet, node: str, kind: str = "hello") -> None:
    body = {
        "resources": {"cpus": 4, "memory_total": 4 * GiB, "memory_available": 2 * GiB},
        "engines": {ENGINE: {"state": "installed", "reason": ""}},
        "shards": list(fleet.shards.get(node, {}).values()),
        "topology": {"fabric": {"label": "lan", "address": f"10.0.0.{ord(node)}"}},
    }
    fleet._say(node, kind, body)


def worker(fleet: Fleet, node: str, wid: str, state: str, **fields) -> None:
    fleet.shard(node, wid, state, model="big", role="rpc-worker",
                endpoint=f"10.0.0.{ord(node)}", **fields)  # fmt: skip


@pytest.fixture
def fleet(tmp_path):
    big = model("big", memory=3 * GiB, engine="vllm", engine_version="0.32.0",
                profile={"memory_bytes": 3 * GiB, "nodes": 2, "context": 2048})  # fmt: skip
    f = Fleet(tmp_path, [big], drain_grace_s=100.0)
    for node in NODES:
        hello(f, node)
    yield f
    f.close()


def placed(fleet: Fleet) -> tuple[str, str, dict]:
    """A pass that places the gang: (leader's node, its id, its start)."""
    fleet.tick()
    ((node, leader),) = fleet.sent("start_shard")
    return node, leader["id"], leader


def joined(fleet: Fleet) -> tuple[str, str, list[tuple[str, dict]]]:
    node, rid, _ = placed(fleet)
    fleet.shard(node, rid, "starting", master=f"10.0.0.{ord(node)}:8102")
    fleet.tick()
    return node, rid, fleet.sent("start_shard")


def test_the_leader_starts_first_as_rank_0_and_its_workers_once_it_says_where_to_meet(fleet):
    node, rid, leader = placed(fleet)
    assert leader["gang"] == {"nnodes": 2, "rank": 0} and "role" not in leader
    assert leader["source"] == "/models/big.gguf" and leader["key"]
    (wid,) = fleet.sched.gangs.jobs[rid].workers
    assert wid == f"{rid}.w1" and fleet.sched.inv.workers[wid].state == "pending"  # booked
    fleet.tick()
    assert fleet.sent("start_shard") == []  # held: the leader has not said where yet
    fleet.shard(node, rid, "starting", master=f"10.0.0.{ord(node)}:8102")
    fleet.tick()
    ((wnode, w),) = fleet.sent("start_shard")
    assert wnode != node and w["id"] == wid and w["role"] == "rpc-worker"
    assert w["gang"] == {"nnodes": 2, "rank": 1, "master": f"10.0.0.{ord(node)}:8102"}
    # It loads its own layers: the model as the leader has it, but no engine key.
    assert (w["source"], w["context"], w["engine"]) == ("/models/big.gguf", 2048, "vllm")
    assert "key" not in w
    fleet.tick()
    assert fleet.sent("start_shard") == []  # sent once
    worker(fleet, wnode, wid, "ready")
    fleet.shard(node, rid, "ready")
    fleet.tick()
    assert fleet.sent("start_shard") == []  # one gang is the one replica wanted
    assert [r["id"] for r in fleet.sched.routes()["replicas"]] == [rid]


def test_a_failed_worker_ends_the_whole_vllm_replica_and_a_new_gang_is_placed(fleet):
    node, rid, ((wnode, w),) = joined(fleet)
    worker(fleet, wnode, w["id"], "ready")
    fleet.shard(node, rid, "ready")
    fleet.tick()
    worker(fleet, wnode, w["id"], "failed", reason="engine exited with status -9")
    fleet.tick()
    assert {b["id"] for _, b in fleet.sent("stop_shard")} == {rid}
    assert "exited with status -9" in fleet.sched.parking.last_error["big"]
    fleet.tick(5)  # after the backoff, placed again, whole
    ((_, again),) = fleet.sent("start_shard")
    assert again["gang"]["rank"] == 0 and again["id"] != rid


def test_a_vllm_leader_that_fails_takes_its_workers_with_it(fleet):
    node, rid, ((wnode, w),) = joined(fleet)
    worker(fleet, wnode, w["id"], "ready")
    fleet.shard(node, rid, "failed", reason="engine exited")
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [w["id"]]


def test_a_gang_of_vllm_ranks_is_adopted_by_a_scheduler_that_restarts(fleet, tmp_path):
    node, rid, ((wnode, w),) = joined(fleet)
    worker(fleet, wnode, w["id"], "ready")
    fleet.shard(node, rid, "ready", master=f"10.0.0.{ord(node)}:8102")
    fleet.tick()
    fleet.sched.gangs.jobs.clear()  # what a new scheduler knows: only what agents report
    fleet.tick()
    assert fleet.sched.gangs.jobs[rid].workers == [w["id"]]
    assert fleet.sent("stop_shard") == [] and fleet.sent("start_shard") == []
