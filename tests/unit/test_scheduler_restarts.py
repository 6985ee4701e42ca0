"""`llmgw restart` through the real scheduler in process, with a fake clock."""

import json

import pytest

from llmgw.store import AuditEntry
from tests.fake_fleet import Fleet, model


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("m", min_=2)], restart_deadline_s=100.0,
              start_timeout_s=1000.0)  # fmt: skip
    f.heartbeat("a", kind="hello")
    f.heartbeat("b", kind="hello")
    yield f
    f.close()


def two_ready(fleet) -> list[str]:
    ids = [fleet.start_ready("a"), fleet.start_ready("b")]
    fleet.tick()
    assert fleet.sent("start_shard") == []
    return ids


def test_max_surge_0_on_a_fleet_with_room_stops_the_old_one_then_starts_its_successor(fleet):
    old, _ = two_ready(fleet)
    with fleet.sched.lock:
        (job,) = fleet.sched.restart([old], fleet.clock(), max_surge=0, max_unavailable=1)
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [old]
    fleet.shard("a", old, "stopped")
    fleet.tick()
    (node, body), *_ = fleet.sent("start_shard")
    fleet.shard(node, body["id"], "ready")
    fleet.tick()
    assert job.state == "done", job.reason


def test_a_restart_queued_past_its_deadline_is_given_up_in_the_log_and_the_audit_log(fleet, caplog):
    first, second = two_ready(fleet)
    fleet.heartbeat("c", kind="hello")  # room for a surge
    with fleet.sched.lock:
        jobs = fleet.sched.restart([first, second], fleet.clock())
    fleet.tick()
    ((node, body),) = fleet.sent("start_shard")
    fleet.shard(node, body["id"], "starting")  # and never ready
    for _ in range(110):
        fleet.clock.advance(1)
        for n in ("a", "b", "c"):
            fleet.heartbeat(n)
        fleet.tick()
    assert [j.state for j in jobs] == ["replacing", "given up"]
    assert "scheduler.restart_deadline_s" in jobs[1].reason
    assert "restart_given_up" in caplog.text and "restart_deadline_s" in caplog.text
    (entry,) = AuditEntry.select().where(AuditEntry.action == "restart.given_up")
    assert (entry.actor, entry.target) == ("scheduler", second)
    assert "restart_deadline_s" in json.loads(entry.detail)["reason"]


def test_a_restart_asked_twice_is_one_job(fleet):
    old, _ = two_ready(fleet)
    with fleet.sched.lock:
        (first,) = fleet.sched.restart([old], fleet.clock())
        (second,) = fleet.sched.restart([old], fleet.clock())
    assert first is second and len(fleet.sched.restarts) == 1


def test_a_surge_restart_starts_the_successor_before_it_stops_the_old_one(fleet):
    old, _ = two_ready(fleet)
    fleet.heartbeat("c", kind="hello")
    with fleet.sched.lock:
        (job,) = fleet.sched.restart([old], fleet.clock())
    fleet.tick()
    ((node, body),) = fleet.sent("start_shard")
    assert fleet.sent("stop_shard") == []
    fleet.shard(node, body["id"], "ready")
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [old]
    assert job.state == "done" and job.replacement == body["id"]


def test_a_takeover_drops_the_restarts_the_old_leadership_queued(fleet, caplog):
    old, _ = two_ready(fleet)
    with fleet.sched.lock:
        fleet.sched.restart([old], fleet.clock())
        fleet.sched.take_over(2, fleet.clock())
    assert fleet.sched.restarts == [] and "restarts_dropped" in caplog.text
