"""On-demand wants: each is answered by the pass after it, in the routing table, and a
model an eviction is making room for reads `starting`, not `unplaceable`."""

import pytest

from llmgw_scheduler.admin import View
from tests.fake_fleet import Fleet, GiB, model


def want(fleet, name: str, n: int, router: str = "router") -> None:
    fleet._say(router, "want", {"model": name, "n": n})


def table_entry(fleet, name: str) -> dict:
    return next(m for m in fleet.sched.routes()["models"] if m["name"] == name)


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("big", memory=4 * GiB, min_=0), model("small", min_=0),
                         model("other", memory=GiB + GiB // 2, min_=0)],
              eviction_min_lifetime_s=0.0)  # fmt: skip
    f.heartbeat("a", memory=2 * GiB, kind="hello")
    yield f
    f.close()


def test_a_want_is_answered_by_the_next_pass_with_what_that_pass_found(fleet):
    want(fleet, "big", 7)
    assert "answered" not in table_entry(fleet, "big")  # no pass yet: no answer
    fleet.tick()
    entry = table_entry(fleet, "big")
    assert entry["answered"] == {"router": 7}
    assert entry["state"] == "unplaceable" and "needs 4 GiB" in entry["reason"]


def test_a_wanted_on_demand_model_with_no_replica_reads_missing(fleet):
    want(fleet, "small", 1)
    fleet.tick()
    m = next(m for m in View(fleet.sched).models() if m["name"] == "small")
    assert (m["ready"], m["desired"], m["min"]) == (0, 1, 0)


def test_a_model_an_eviction_makes_room_for_reads_starting_until_the_room_is_there(fleet):
    want(fleet, "other", 1)
    rid = fleet.start_ready("a")
    want(fleet, "small", 2)  # 1 GiB: with other's 1.5 GiB on a 2 GiB node, no room
    fleet.heartbeat("a", memory=GiB // 2)
    fleet.tick()
    assert "other" in fleet.sched.evicted_at
    entry = table_entry(fleet, "small")
    assert entry["answered"] == {"router": 2}
    assert entry["state"] == "starting", entry["reason"]
    fleet.tick()  # the evicted model is stopped; small still waits for the room
    assert [b["id"] for _, b in fleet.sent("stop_shard")] == [rid]
    assert table_entry(fleet, "small")["state"] == "starting"
    fleet.shard("a", rid, "stopped")
    fleet.heartbeat("a", memory=2 * GiB)
    fleet.tick()
    assert [b["model"] for _, b in fleet.sent("start_shard")] == ["small"]
