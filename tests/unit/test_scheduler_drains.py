"""`llmgw nodes drain` through the real scheduler in process: replacements start first,
then the drained node's replicas stop; an overdue drain stops them anyway."""

import pytest

from llmgw.store import DrainedNode
from tests.fake_fleet import Fleet, model


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("m")], drain_grace_s=100.0)
    f.heartbeat("a", kind="hello")
    yield f
    f.close()


def drain(fleet, node: str) -> None:
    with fleet.sched.lock:
        fleet.sched.drain(node, fleet.clock())


def test_a_drained_node_s_replica_stops_only_once_its_replacement_is_ready(fleet):
    old = fleet.start_ready("a")
    fleet.heartbeat("b", kind="hello")
    drain(fleet, "a")
    new = fleet.start_ready("b")  # the replacement goes to the other node
    assert fleet.sent("stop_shard") == []  # started, not yet ready when it was sent
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [old]
    assert new != old and fleet.sched.inv.replicas[new].node == "b"


def test_a_drained_node_s_last_replica_stops_when_the_grace_period_is_over(fleet):
    old = fleet.start_ready("a")
    drain(fleet, "a")
    fleet.tick(50)
    fleet.heartbeat("a")
    assert fleet.sent("stop_shard") == []  # nowhere else to go: it keeps serving
    fleet.tick(51)
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [old]


def test_a_drain_is_kept_in_the_store_and_an_undrain_forgets_it(fleet):
    drain(fleet, "a")
    assert [r.name for r in DrainedNode.select()] == ["a"]
    assert fleet.sched.inv.nodes["a"].draining
    fleet.tick()
    assert fleet.sent("start_shard") == []  # the only node is draining
    with fleet.sched.lock:
        fleet.sched.undrain("a")
    assert DrainedNode.select().count() == 0
    fleet.tick()
    assert [n for n, _ in fleet.sent("start_shard")] == ["a"]
