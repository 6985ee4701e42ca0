"""Autoscaling in the scheduler, on a fake clock: routers' load reports drive a model
between its min and max, and a scale-up that fits nowhere is blocked, with why."""

import pytest
from prometheus_client import CollectorRegistry

from llmgw import audit
from llmgw_ctl.status import print_models
from llmgw_scheduler import metrics
from llmgw_scheduler.admin import View
from tests.fake_fleet import Fleet, GiB, model

SCALING = {"up_after_s": 30.0, "down_after_s": 300.0, "down_below": 0.3, "cooldown_s": 120.0}


def busy(fleet, load: dict, seconds: float, idle: dict | None = None,
         memory: int = 8 * GiB) -> None:  # fmt: skip
    """Routers report `load` (replica -> [in flight, slots]) every 5 s for `seconds`,
    with node a's heartbeat and a pass after each report."""
    for _ in range(int(seconds / 5)):
        fleet.heartbeat("a", memory=memory)
        fleet.activity("router", {"idle_s": {"chat": 0.0}, "replica_load": load,
                                  "replica_idle_s": idle or {}})  # fmt: skip
        fleet.tick(5)


def model_view(fleet, name: str = "chat") -> dict:
    return next(m for m in View(fleet.sched).models() if m["name"] == name)


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("chat", min_=1, max_=2, scaling=SCALING)])
    f.heartbeat("a", kind="hello")
    yield f
    f.close()


def test_a_saturated_model_gets_a_second_replica_and_gives_it_back_when_load_ends(fleet):
    first = fleet.start_ready("a")
    fleet.sent()
    busy(fleet, {first: [4, 4]}, 25)
    assert fleet.sent("start_shard") == [] and model_view(fleet)["desired"] == 1
    busy(fleet, {first: [4, 4]}, 10)
    starts = fleet.sent("start_shard")
    assert len(starts) == 1
    view = model_view(fleet)
    assert view["desired"] == 2 and "1 of 1 replicas saturated 30 s" in view["desired_reason"]
    second = starts[0][1]["id"]
    fleet.shard("a", second, "ready")

    # The load ends: after down_after_s the replica with the fewest requests in flight
    # is given back, though the other has been idle longer.
    quiet = {first: [1, 4], second: [0, 4]}
    busy(fleet, quiet, 295, idle={first: 40.0, second: 0.0})
    assert fleet.sent("stop_shard") == []
    busy(fleet, quiet, 10, idle={first: 40.0, second: 0.0})
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [second]
    view = model_view(fleet)
    assert view["desired"] == 1 and "scaled down" in view["desired_reason"]
    actions = [e["action"] for e in audit.recent(action="models.scale")]
    assert actions == ["models.scale_up", "models.scale_down"]


def test_a_scale_up_that_fits_nowhere_is_blocked_with_the_placement_reason(tmp_path):
    f = Fleet(tmp_path, [model("chat", min_=1, max_=2, scaling=SCALING)])
    try:
        registry = CollectorRegistry()
        metrics.watch_fleet(f.sched, registry)
        f.heartbeat("a", memory=GiB + GiB // 2, kind="hello")
        first = f.start_ready("a")
        busy(f, {first: [4, 4]}, 40, memory=GiB + GiB // 2)
        view = model_view(f)
        assert view["desired"] == 2
        assert view["desired_reason"] == "cannot scale up: needs 1.0 GiB, largest free 0.5"
        sample = registry.get_sample_value
        assert sample("llmgw_model_scale_blocked", {"model": "chat"}) == 1
        assert sample("llmgw_model_scale_decisions_total", {"direction": "up"}) == 1
        assert sample("llmgw_model_replicas_desired", {"model": "chat"}) == 2
    finally:
        f.close()


def test_a_router_that_stops_reporting_no_longer_holds_a_model_up(fleet):
    first = fleet.start_ready("a")
    busy(fleet, {first: [4, 4]}, 20)
    for _ in range(6):  # 30 s more with no report: its last word ages out
        fleet.heartbeat("a")
        fleet.tick(5)
    assert model_view(fleet)["desired"] == 1 and fleet.sent("start_shard") == []
    assert "router" not in fleet.sched.loads.reports


def test_llmgw_models_shows_what_a_model_wants_now_and_why(fleet, capsys):
    first = fleet.start_ready("a")
    busy(fleet, {first: [4, 4]}, 35)
    print_models(View(fleet.sched).models(), detail=True)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("chat"))
    assert " 1/2 " in line and "1 of 1 replicas saturated 30 s" in line


def test_a_restarts_surge_replica_is_not_given_back_as_a_surplus(fleet):
    old = fleet.start_ready("a")
    busy(fleet, {old: [0, 4]}, 5)  # the replacement is the newer: a tie would pick it
    with fleet.sched.lock:
        (job,) = fleet.sched.restart([old], fleet.clock(), max_surge=1, max_unavailable=0)
    fleet.tick()
    ((node, body),) = fleet.sent("start_shard")
    fleet.shard(node, body["id"], "ready")  # two ready, one desired: the restart's doing
    busy(fleet, {old: [0, 4], body["id"]: [0, 4]}, 5)
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [old]
    assert job.state in ("stopping", "done"), job.state
