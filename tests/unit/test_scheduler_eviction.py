"""Eviction through the real scheduler in process, on a fake clock: a wanted on-demand
model that fits nowhere retires the other on-demand model cheapest to bring back (its
cold start times its recent demand; the least recently used of equals), never one kept
by min, and never one ready for less than scheduler.eviction_min_lifetime_s."""

import math

import pytest
from prometheus_client import CollectorRegistry

from llmgw_scheduler import metrics
from llmgw_scheduler.coldstarts import ColdStarts
from llmgw_scheduler.demand import DEMAND_WINDOW_S, Demand
from llmgw_scheduler.eviction import Candidate, choose
from tests.fake_fleet import Fleet, GiB, model

LIFETIME_S = 60.0


def want(fleet, name: str, n: int = 1) -> None:
    fleet._say("router", "want", {"model": name, "n": n})


def used(fleet, name: str) -> None:
    """A router's activity report: `name` answered a request just now."""
    fleet.activity("router", {"idle_s": {name: 0}})


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("old", min_=0), model("recent", min_=0), model("new", min_=0),
                         model("kept", min_=1)],
              eviction_min_lifetime_s=LIFETIME_S, node_lost_s=1e9)  # fmt: skip
    f.heartbeat("a", memory=4 * GiB, kind="hello")
    yield f
    f.close()


def come_up(fleet, node: str, name: str, load_s: float = 0.0) -> str:
    """Want `name`, start it on `node` and report it ready `load_s` later."""
    want(fleet, name)
    fleet.tick()
    (start,) = [b for n, b in fleet.sent("start_shard") if n == node and b["model"] == name]
    fleet.clock.advance(load_s)
    fleet.shard(node, start["id"], "ready")
    return start["id"]


def serve_all(fleet, load_s: dict | None = None) -> dict[str, str]:
    """kept, old and recent ready on node a (used in that order, each 10 s to come up
    unless `load_s` says otherwise), with no room left, all past their minimum lifetime."""
    ids = {"kept": fleet.start_ready("a")}
    for name in ("old", "recent"):
        ids[name] = come_up(fleet, "a", name, (load_s or {}).get(name, 10.0))
        fleet.clock.advance(10)
    fleet.heartbeat("a", memory=GiB // 2)
    fleet.clock.advance(LIFETIME_S)
    return ids


def test_the_least_recently_used_of_equally_costly_models_is_evicted_for_a_wanted_one(fleet):
    ids = serve_all(fleet)
    want(fleet, "new")
    fleet.tick()
    assert list(fleet.sched.evicted_at) == ["old"]
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [ids["old"]]
    fleet.shard("a", ids["old"], "stopped")
    fleet.heartbeat("a", memory=3 * GiB)  # the two left still reserve their 1 GiB each
    fleet.tick()
    assert [b["model"] for _, b in fleet.sent("start_shard")] == ["new"]


def test_a_model_used_again_after_its_peer_is_not_the_one_evicted(fleet):
    ids = serve_all(fleet)
    fleet._say("router", "activity", {"idle_s": {"old": 0}})  # old was used just now
    want(fleet, "new")
    fleet.tick()
    assert list(fleet.sched.evicted_at) == ["recent"]
    fleet.tick()
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [ids["recent"]]


def test_the_model_slower_to_come_back_stays_though_it_was_used_least_recently(fleet):
    serve_all(fleet, load_s={"old": 120.0, "recent": 5.0})
    assert fleet.sched.coldstarts.of("old") == 120.0
    want(fleet, "new")
    fleet.tick()
    assert list(fleet.sched.evicted_at) == ["recent"]


def test_the_model_in_more_demand_stays_though_it_was_used_least_recently(fleet):
    serve_all(fleet)
    for _ in range(5):  # old answered a request in each of five reports, 2 s apart
        fleet.clock.advance(2)
        used(fleet, "old")
    fleet.clock.advance(2)
    used(fleet, "recent")  # once, more recently than old's last
    assert fleet.sched.demand.rate("old", fleet.clock()) > fleet.sched.demand.rate(
        "recent", fleet.clock()
    )
    want(fleet, "new")
    fleet.tick()
    assert list(fleet.sched.evicted_at) == ["recent"]


def test_a_model_ready_less_than_its_minimum_lifetime_is_kept_and_the_wanted_one_says_why(
    tmp_path,
):
    f = Fleet(tmp_path, [model("b", memory=3 * GiB, min_=0), model("c", memory=3 * GiB, min_=0)],
              eviction_min_lifetime_s=300.0, node_lost_s=1e9)  # fmt: skip
    try:
        f.heartbeat("a", memory=4 * GiB, kind="hello")
        come_up(f, "a", "b")
        f.heartbeat("a", memory=GiB)
        f.clock.advance(88)
        want(f, "c")
        f.tick()
        assert f.sched.evicted_at == {}
        state, reason = f.sched.model_status("c")
        assert state == "unplaceable"
        assert reason.endswith(
            "no room: b holds it and may not be evicted for another 212 s"
            " (scheduler.eviction_min_lifetime_s = 300)"
        ), reason
        entry = next(m for m in f.sched.routes()["models"] if m["name"] == "c")
        assert entry["state"] == "unplaceable" and "212 s" in entry["reason"]
        f.tick(100)
        assert "for another 112 s" in f.sched.model_status("c")[1]
        f.clock.advance(111)
        used(f, "b")  # both still in use when b has had its 300 s
        want(f, "c")
        f.tick(1)
        assert list(f.sched.evicted_at) == ["b"]
        assert f.sched.model_status("c")[0] == "starting"
    finally:
        f.close()


def test_a_model_still_starting_is_not_evicted(tmp_path):
    f = Fleet(tmp_path, [model("b", memory=3 * GiB, min_=0), model("c", memory=3 * GiB, min_=0)],
              eviction_min_lifetime_s=30.0, node_lost_s=1e9)  # fmt: skip
    try:
        f.heartbeat("a", memory=4 * GiB, kind="hello")
        want(f, "b")
        f.tick()
        (start,) = f.sent("start_shard")
        f.shard("a", start[1]["id"], "starting")
        f.heartbeat("a", memory=GiB)
        f.clock.advance(50)  # past its minimum lifetime, not yet past start_timeout_s
        want(f, "c")
        f.tick()
        assert f.sched.evicted_at == {}
        assert "until it has been ready 30 s" in f.sched.model_status("c")[1]
    finally:
        f.close()


def test_two_on_demand_models_that_cannot_both_fit_no_longer_evict_each_other_in_turn(tmp_path):
    f = Fleet(tmp_path, [model("b", memory=3 * GiB, min_=0), model("c", memory=3 * GiB, min_=0)],
              eviction_min_lifetime_s=300.0, node_lost_s=1e9)  # fmt: skip
    try:
        registry = CollectorRegistry()
        metrics.watch_fleet(f.sched, registry)
        f.heartbeat("a", memory=4 * GiB, kind="hello")
        come_up(f, "a", "b")
        f.heartbeat("a", memory=GiB)
        starts = 1
        for _ in range(20):  # c, b, c, b ... every 10 s for 200 s: b stays, c waits
            for name in ("c", "b"):
                want(f, name)
                f.tick(5)
                starts += len(f.sent("start_shard"))
        assert f.sched.evicted_at == {} and starts == 1
        assert registry.get_sample_value("llmgw_model_evictions_total", {"model": "b"}) == 0
        f.tick(100)  # b has been ready 300 s: c, asked for all along, takes its place
        assert list(f.sched.evicted_at) == ["b"]
        assert registry.get_sample_value("llmgw_model_evictions_total", {"model": "b"}) == 1
    finally:
        f.close()


def test_a_model_whose_room_is_coming_evicts_nothing_more(fleet):
    serve_all(fleet)
    want(fleet, "new")
    fleet.tick()
    assert list(fleet.sched.evicted_at) == ["old"]
    fleet.tick()  # old is stopping; its memory is not reported free yet
    fleet.tick()
    assert list(fleet.sched.evicted_at) == ["old"]
    assert fleet.sched.model_status("new")[0] == "starting"


def test_nothing_is_evicted_for_a_model_that_would_not_fit_even_then(tmp_path):
    big = Fleet(tmp_path, [model("huge", memory=64 * GiB, min_=0), model("m", min_=0)],
                eviction_min_lifetime_s=0.0, node_lost_s=1e9)  # fmt: skip
    try:
        big.heartbeat("a", memory=4 * GiB, kind="hello")
        want(big, "m")
        big.start_ready("a")
        want(big, "huge")
        big.tick()
        assert big.sched.evicted_at == {}
        assert big.sched.model_status("huge") == ("unplaceable", "a: needs 64 GiB, 3 GiB free")
    finally:
        big.close()


def test_a_replica_s_time_from_start_to_ready_is_its_model_s_cold_start(fleet):
    come_up(fleet, "a", "old", load_s=40.0)
    assert fleet.sched.coldstarts.of("old") == 40.0
    # Ready heard of from a heartbeat only (its shard_status was lost) counts as well.
    want(fleet, "recent")
    fleet.tick()
    (start,) = fleet.sent("start_shard")
    fleet.clock.advance(20.0)
    fleet.shards["a"][start[1]["id"]] = {"id": start[1]["id"], "model": "recent",
                                         "state": "ready", "endpoint": "http://a:1"}  # fmt: skip
    fleet.heartbeat("a")
    assert fleet.sched.coldstarts.of("recent") == 20.0
    assert fleet.sched.coldstarts.of("new") == 60.0  # never started: the default


def test_the_cheapest_past_its_lifetime_is_chosen_and_a_held_one_only_named():
    cheap_young = Candidate("young", cost=1.0, last_active=5.0, held_until=200.0)
    dear = Candidate("dear", cost=50.0, last_active=1.0, held_until=50.0)
    cheap = Candidate("cheap", cost=2.0, last_active=9.0, held_until=-math.inf)
    assert choose([cheap_young, dear, cheap], now=100.0) == (cheap, None)
    assert choose([cheap_young, dear], now=100.0) == (dear, None)
    assert choose([cheap_young, dear], now=10.0) == (None, dear)  # the one free soonest
    twin = Candidate("twin", cost=2.0, last_active=3.0, held_until=-math.inf)
    assert choose([cheap, twin], now=100.0) == (twin, None)  # equals: least recently used
    assert choose([], now=0.0) == (None, None)


def test_recent_demand_counts_each_use_once_and_forgets_uses_past_its_window():
    d = Demand()
    d.want("m", "router", 1, now=0.0)
    for now in (2.0, 4.0, 6.0):  # each report repeats the same last use
        d.used("m", idle_s=now, now=now)
    assert d.rate("m", 6.0) == 60.0 / DEMAND_WINDOW_S
    d.used("m", idle_s=0.0, now=8.0)  # a new request
    assert d.rate("m", 8.0) == 2 * 60.0 / DEMAND_WINDOW_S
    assert d.rate("m", DEMAND_WINDOW_S + 1.0) == 60.0 / DEMAND_WINDOW_S  # the first is gone
    assert d.rate("other", 8.0) == 0.0


def test_a_slow_start_moves_a_model_s_cold_start_halfway_not_for_good():
    c = ColdStarts()
    c.record("m", 10.0)
    c.record("m", 110.0)
    assert c.of("m") == 60.0
