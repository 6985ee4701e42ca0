"""Parking through the real scheduler in process: five failed starts park a model,
`llmgw retry` un-parks it, and a park outlives the scheduler."""

import pytest

from llmgw.store import ParkedModel
from tests.fake_fleet import Fleet, model


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("m")])
    f.heartbeat("a", kind="hello")
    yield f
    f.close()


def fail_starts(fleet, times: int) -> None:
    for _ in range(times):
        fleet.clock.advance(400)  # past any backoff
        fleet.heartbeat("a")
        fleet.tick()
        ((node, body),) = fleet.sent("start_shard")
        fleet.shard(node, body["id"], "failed", "error loading model: bad magic")


def test_a_parked_model_is_not_started_again_however_long_it_waits(fleet):
    fail_starts(fleet, 5)
    assert fleet.sched.model_status("m")[0] == "parked"
    for _ in range(5):
        fleet.clock.advance(3600)
        fleet.heartbeat("a")
        fleet.tick()
    assert fleet.sent("start_shard") == []


def test_four_failed_starts_back_off_and_do_not_park(fleet):
    fail_starts(fleet, 4)
    assert "m" not in fleet.sched.parked
    assert fleet.sched.model_status("m") == ("backoff", "error loading model: bad magic")


def test_a_retry_unparks_the_model_forgets_its_failures_and_starts_it_at_once(fleet):
    fail_starts(fleet, 5)
    with fleet.sched.lock:
        fleet.sched.retry("m")
    assert fleet.sched.wake and "m" not in fleet.sched.parked
    assert ParkedModel.select().count() == 0
    fleet.tick()  # no time passes: no backoff left to wait out
    ((node, body),) = fleet.sent("start_shard")
    fleet.shard(node, body["id"], "ready")
    assert fleet.sched.model_status("m") == ("serving", "")


def test_a_park_is_read_back_by_the_next_scheduler_on_the_store(fleet, tmp_path):
    fail_starts(fleet, 5)
    again = Fleet(tmp_path, [model("m")])
    try:
        assert again.sched.model_status("m")[0] == "parked"
        assert "bad magic" in again.sched.parked["m"].reason
    finally:
        again.close()


def test_a_park_is_forgotten_when_the_model_s_definition_changes(fleet, tmp_path):
    fail_starts(fleet, 5)
    again = Fleet(tmp_path, [model("m", engine_version="0.3.35")])
    try:
        assert "m" not in again.sched.parked
    finally:
        again.close()
