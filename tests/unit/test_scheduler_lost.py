"""A replica on a lost node is `lost` and counts toward nothing, in every view of it;
the routing table keeps it only while its model has no ready replica on a live node."""

import pytest

from llmgw_scheduler import page
from llmgw_scheduler.admin import View
from tests.fake_fleet import Fleet, model
from tests.unit.test_scheduler_failures import lose


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("m")])
    f.heartbeat("a", kind="hello")
    f.heartbeat("b", kind="hello")
    yield f
    f.close()


def test_a_lost_node_s_replica_is_lost_and_its_model_reads_one_of_one_not_two(fleet):
    old = fleet.start_ready("a")
    fleet.crash("a")
    lose(fleet, "a")
    starts = [b for n, b in fleet.sent("start_shard") if n == "b"]
    assert len(starts) == 1
    fleet.shard("b", starts[0]["id"], "ready")

    view = View(fleet.sched)
    by_id = {r["id"]: r for r in view.replicas()}
    assert by_id[old]["state"] == "lost"
    assert by_id[starts[0]["id"]]["state"] == "ready"
    (m,) = view.models()
    assert (m["ready"], m["desired"], m["replicas"], m["lost"]) == (1, 1, 1, 1)
    assert m["state"] == "serving"
    nodes = {n["name"]: n for n in view.nodes()}
    assert nodes["a"]["state"] == "lost"
    assert nodes["a"]["memory_available"] is None  # nothing it last said is in use
    html = page.render(view.nodes(), view.models(), view.replicas(), fleet.clock())
    assert "unknown (lost)" in html and "+1 lost" in html
    # Served from the live node only, now that there is one.
    assert [r["id"] for r in fleet.sched.routes()["replicas"]] == [starts[0]["id"]]


def test_a_lost_node_s_ready_replica_stays_routable_while_nothing_live_serves(fleet):
    old = fleet.start_ready("a")
    fleet.crash("a")
    lose(fleet, "a")
    view = View(fleet.sched)
    (m,) = view.models()
    assert m["ready"] == 0 and m["state"] != "serving"
    assert [r["id"] for r in fleet.sched.routes()["replicas"]] == [old]


def test_a_lost_node_that_comes_back_with_its_replica_has_it_ready_again(fleet):
    old = fleet.start_ready("a")
    lose(fleet, "a")  # a partition: the engine kept running
    fleet.heartbeat("a")
    assert {r["id"]: r["state"] for r in View(fleet.sched).replicas()}[old] == "ready"
    assert not fleet.sched.inv.replicas[old].orphaned


def test_a_removed_node_is_forgotten_not_lost_and_its_model_is_placed_elsewhere(fleet):
    old = fleet.start_ready("a")
    fleet.sched.drains.drain("a", fleet.clock())
    with fleet.sched.lock:
        fleet.sched.forget_node("a")  # `llmgw nodes remove a --force`, seen by this scheduler
    for _ in range(int(fleet.cfg.scheduler.node_lost_s) + 2):  # past node_lost_s
        fleet.tick(1)
        fleet.heartbeat("b")
    view = View(fleet.sched)
    assert [n["name"] for n in view.nodes()] == ["b"]
    assert [n["name"] for n in view.placement(fleet.sched.model("m"))["nodes"]] == ["b"]
    assert old not in {r["id"] for r in view.replicas()}
    (m,) = view.models()
    assert m["lost"] == 0 and "a" not in fleet.sched.drained
    assert [n for n, _ in fleet.sent("start_shard")] == ["b"]  # its replacement
