"""A takeover through the real scheduler in process: the new leader reads the parks,
drains and start intents the last one left in the store, and starts nothing twice."""

import json

import pytest

from llmgw import bus
from llmgw.store import DrainedNode, ReplicaIntent
from tests.fake_fleet import Fleet, model


@pytest.fixture
def pair(tmp_path):
    """A leader and a standby on the same store, both hearing nodes a and b."""
    leader = Fleet(tmp_path, [model("m", min_=2, max_=2)])
    standby = Fleet(tmp_path, [model("m", min_=2, max_=2)], leading=False)
    for f in (leader, standby):
        f.heartbeat("a", kind="hello")
        f.heartbeat("b", kind="hello")
    yield leader, standby
    standby.close()
    leader.close()


def start_two(fleet) -> list[tuple[str, dict]]:
    """Two passes: one start each (a pass starts one replica of a model at a time)."""
    fleet.tick()
    fleet.tick()
    starts = fleet.sent("start_shard")
    assert len(starts) == 2
    return starts


def take_over(fleet, epoch: int = 2) -> None:
    fleet.is_leading = True
    with fleet.sched.lock:
        fleet.sched.take_over(epoch, fleet.clock())


def test_a_new_leader_does_not_start_what_the_last_one_was_starting(pair):
    leader, standby = pair
    started = {b["id"] for _, b in start_two(leader)}
    assert ReplicaIntent.select().count() == 2
    take_over(standby)  # the old leader died before any agent reported the starts
    assert [b["epoch"] for _, b in standby.sent("leader")] == [2, 2]
    standby.tick()
    assert standby.sent("start_shard") == []
    assert set(standby.sched.inv.replicas) == started


def test_an_intent_never_reported_is_started_again_after_the_start_timeout(pair):
    leader, standby = pair
    start_two(leader)
    take_over(standby)
    standby.tick(61)  # past start_timeout_s, and the agents never heard of them
    for node in ("a", "b"):
        standby.heartbeat(node)
    standby.sent()
    assert len(start_two(standby)) == 2


def test_reported_intents_are_deleted_from_the_store_after_the_pass(pair):
    leader, standby = pair
    for node, body in start_two(leader):
        leader.shard(node, body["id"], "starting")
    assert ReplicaIntent.select().count() == 2  # reported, deleted at the next pass
    leader.tick()
    assert ReplicaIntent.select().count() == 0


def test_a_new_leader_reads_parks_and_drains_the_last_one_made(pair):
    leader, standby = pair
    with leader.sched.lock:
        leader.sched.drain("a", leader.clock())
    for _ in range(5):
        leader.clock.advance(400)
        leader.heartbeat("b")
        leader.tick()
        ((node, body), *_) = leader.sent("start_shard")
        leader.shard(node, body["id"], "failed", "bad magic")
    assert "m" in leader.sched.parked and DrainedNode.select().count() == 1
    assert "m" not in standby.sched.parked  # a standby keeps the count, not the park
    take_over(standby)
    assert "m" in standby.sched.parked
    assert standby.sched.inv.nodes["a"].draining
    standby.tick()
    assert standby.sent("start_shard") == []


def test_a_leader_that_hears_of_a_newer_epoch_steps_down(pair):
    leader, _ = pair
    leader.lease.epoch = 1
    leader.heartbeat("a")  # epoch 0: nothing newer
    assert leader.is_leading
    msg = json.loads(bus.encode("heartbeat", "a", {}, 3))
    with leader.sched.lock:
        leader.sched.handle("a", msg)
    assert not leader.is_leading and "epoch 3" in leader.lease.lost[0]
