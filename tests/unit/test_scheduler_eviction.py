"""Eviction through the real scheduler in process: a wanted on-demand model that fits
nowhere retires the least recently used other on-demand model, never one kept by min."""

import pytest

from tests.fake_fleet import Fleet, GiB, model


def want(fleet, name: str, n: int = 1) -> None:
    fleet._say("router", "want", {"model": name, "n": n})


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("old", min_=0), model("recent", min_=0), model("new", min_=0),
                         model("kept", min_=1)])  # fmt: skip
    f.heartbeat("a", memory=4 * GiB, kind="hello")
    yield f
    f.close()


def serve_all(fleet) -> dict[str, str]:
    """kept, old and recent ready on node a (used in that order), with no room left."""
    ids = {"kept": fleet.start_ready("a")}
    for name in ("old", "recent"):
        want(fleet, name)
        ids[name] = fleet.start_ready("a")
        fleet.clock.advance(10)
    fleet.heartbeat("a", memory=GiB // 2)
    return ids


def test_the_least_recently_used_on_demand_model_is_evicted_for_a_wanted_one(fleet):
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


def test_nothing_is_evicted_for_a_model_that_would_not_fit_even_then(tmp_path):
    big = Fleet(tmp_path, [model("huge", memory=64 * GiB, min_=0), model("m", min_=0)])
    try:
        big.heartbeat("a", memory=4 * GiB, kind="hello")
        want(big, "m")
        big.start_ready("a")
        want(big, "huge")
        big.tick()
        assert big.sched.evicted_at == {}
        assert big.sched.model_status("huge")[0] == "unplaceable"
    finally:
        big.close()
