"""Replicas across nodes through the real scheduler in process: workers first, the leader
held until they listen, and the whole gang ended when any part of it fails."""

import pytest

from tests.fake_fleet import Fleet, GiB, model

NODES = ("a", "b", "c")


def hello(fleet: Fleet, node: str, memory: int = 2 * GiB, kind: str = "hello") -> None:
    body = {
        "resources": {"cpus": 4, "memory_total": 4 * GiB, "memory_available": memory},
        "engines": {"llama.cpp-0.3.36": {"state": "installed", "reason": ""}},
        "shards": list(fleet.shards.get(node, {}).values()),
        "topology": {"fabric": {"label": "lan", "address": f"10.0.0.{ord(node)}"}},
    }
    fleet._say(node, kind, body)


def worker(fleet: Fleet, node: str, wid: str, state: str, **fields) -> None:
    fleet.shard(node, wid, state, model="big", role="rpc-worker",
                endpoint=f"10.0.0.{ord(node)}:50052", **fields)  # fmt: skip


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("big", memory=3 * GiB, profile={"memory_bytes": 3 * GiB,
                                                                "nodes": "auto"})],
              drain_grace_s=100.0)  # fmt: skip
    for node in NODES:
        hello(f, node)
    yield f
    f.close()


def place(fleet: Fleet) -> tuple[str, list[tuple[str, dict]]]:
    """A pass that places the gang: (the leader's id, the workers' starts)."""
    fleet.tick()
    starts = fleet.sent("start_shard")
    assert starts and all(b.get("role") == "rpc-worker" for _, b in starts), starts
    rid = starts[0][1]["id"].rpartition(".w")[0]
    return rid, starts


def up(fleet: Fleet) -> tuple[str, list[tuple[str, dict]]]:
    rid, starts = place(fleet)
    for node, body in starts:
        worker(fleet, node, body["id"], "ready")
    fleet.tick()
    ((node, leader),) = fleet.sent("start_shard")
    fleet.shard(node, rid, "ready")
    return rid, starts


def test_a_model_too_big_for_one_node_starts_its_workers_first_and_its_leader_last(fleet):
    rid, starts = place(fleet)
    assert len(starts) == 2 and len({n for n, _ in starts}) == 2
    assert fleet.sched.inv.replicas[rid].state == "pending"  # held, booked, not sent
    worker(fleet, starts[0][0], starts[0][1]["id"], "ready")
    fleet.tick()
    assert fleet.sent("start_shard") == []  # one worker is not enough
    worker(fleet, starts[1][0], starts[1][1]["id"], "ready")
    fleet.tick()
    ((node, leader),) = fleet.sent("start_shard")
    assert leader["id"] == rid and node == starts[0][0]
    assert leader["rpc"] == [f"10.0.0.{ord(n)}:50052" for n, _ in starts]
    assert sum(leader["tensor_split"]) == pytest.approx(1.0, abs=0.001)
    fleet.shard(node, rid, "ready")
    fleet.tick()
    assert fleet.sent("start_shard") == []  # one gang is the one replica wanted
    routes = fleet.sched.routes()["replicas"]
    assert [r["id"] for r in routes] == [rid]  # workers serve nothing themselves


def test_a_failed_worker_ends_the_whole_replica_and_a_new_gang_is_placed(fleet):
    rid, starts = up(fleet)
    (node, body) = starts[1]
    worker(fleet, node, body["id"], "failed", reason="rpc-server exited with status 9")
    fleet.tick()
    stops = {b["id"] for _, b in fleet.sent("stop_shard")}
    assert stops == {rid, starts[0][1]["id"]}  # the leader and the other worker
    assert "rpc-server exited" in fleet.sched.parking.last_error["big"]
    fleet.tick(5)  # after the backoff, placed again, whole
    new = {b["id"].rpartition(".w")[0] for _, b in fleet.sent("start_shard")}
    assert len(new) == 1 and rid not in new


def test_a_leader_that_fails_takes_its_workers_with_it(fleet):
    rid, starts = up(fleet)
    fleet.shard(starts[0][0], rid, "failed", reason="llama-server exited")
    fleet.tick()
    assert {b["id"] for _, b in fleet.sent("stop_shard")} == {b["id"] for _, b in starts}


def test_a_worker_whose_leader_no_scheduler_knows_is_stopped(fleet):
    worker(fleet, "c", "r-gone.w1", "ready")
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == ["r-gone.w1"]


def test_a_gang_on_a_draining_node_is_replaced_whole_before_it_stops(fleet):
    rid, starts = up(fleet)
    hello(fleet, "d", kind="hello")
    drained = starts[1][0]
    with fleet.sched.lock:
        fleet.sched.drain(drained, fleet.clock())
    fleet.tick()
    new_starts = fleet.sent("start_shard")
    assert fleet.sent("stop_shard") == []
    assert drained not in {n for n, _ in new_starts}
    new = new_starts[0][1]["id"].rpartition(".w")[0]
    for node, body in new_starts:
        worker(fleet, node, body["id"], "ready")
    fleet.tick()
    ((node, _),) = fleet.sent("start_shard")
    assert fleet.sent("stop_shard") == []  # the new one is not serving yet
    fleet.shard(node, new, "ready")
    fleet.tick()
    # The old gang stops, whole; the new one is not taken for a surplus of the autoscaler.
    assert {b["id"] for _, b in fleet.sent("stop_shard")} == {rid, *(b["id"] for _, b in starts)}


def test_a_split_replica_cannot_be_restarted_and_says_why(fleet):
    from llmgw.errors import Conflict

    rid, _ = up(fleet)
    with pytest.raises(Conflict, match="spans nodes") as e:
        fleet.sched.restart([rid], fleet.clock())
    assert e.value.code == "split_replica"


def test_workers_count_toward_their_nodes_memory(fleet):
    rid, starts = place(fleet)
    views = {v.id: v for v in fleet.sched.node_views()}
    for node, _ in starts:
        assert views[node].memory_free < 2 * GiB  # its part is booked
    idle = next(n for n in NODES if n not in {n for n, _ in starts})
    assert views[idle].memory_free == 2 * GiB


def test_a_leader_s_size_does_not_teach_the_scheduler_the_model_s(fleet):
    from llmgw.store import MeasuredCapacity

    rid, starts = place(fleet)
    for node, body in starts:
        worker(fleet, node, body["id"], "ready")
    fleet.tick()
    ((node, _),) = fleet.sent("start_shard")
    fleet.shard(node, rid, "ready", rss=300 << 20)  # the leader alone: a small part
    assert MeasuredCapacity.select().count() == 0  # no "measured" size of the model
