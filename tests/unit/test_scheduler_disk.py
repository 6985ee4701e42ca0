"""Mirrored weights need room on the node that fetches them: a node short of disk is
passed over, and said to be, unless it has them already."""

import pytest

from llmgw.placement import GiB
from llmgw_scheduler.admin import View
from tests.fake_fleet import Fleet, model


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("m")])
    m = f.sched.models["m"]
    f.sched.needs.mirrored["m"] = (m.source, "c" * 64, 4 * GiB)
    yield f
    f.close()


def test_the_replica_goes_to_the_node_with_room_for_its_weights(fleet):
    fleet.heartbeat("a", kind="hello", memory=15 * GiB, disk_free=GiB)
    fleet.heartbeat("b", kind="hello", memory=2 * GiB, disk_free=100 * GiB)
    fleet.start_ready("b")
    placement = View(fleet.sched).placement(fleet.sched.models["m"])
    reasons = {n["name"]: n["reason"] for n in placement["nodes"]}
    assert reasons["a"] == "needs 4 GiB of disk for its weights, 1 GiB free"


def test_no_node_with_room_makes_the_model_unplaceable_saying_so(fleet):
    fleet.heartbeat("a", kind="hello", disk_free=GiB)
    fleet.tick()
    assert fleet.sent("start_shard") == []
    state, reason = fleet.sched.model_status("m")
    assert state == "unplaceable" and "of disk for its weights" in reason


def test_a_node_that_has_the_weights_already_needs_no_room(fleet):
    fleet.heartbeat("a", kind="hello", disk_free=GiB, weights=["c" * 64])
    fleet.start_ready("a")
