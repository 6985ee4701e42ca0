"""The scheduler's diffs of its routing table (tools/scheduler/published.py)."""

from llmgw_scheduler.published import Published


def body(seq, *replicas, models=()):
    return {"seq": seq, "replicas": [dict(r) for r in replicas], "models": list(models)}


def rep(rid, endpoint="http://n1:8100"):
    return {"id": rid, "model": "m", "endpoint": endpoint, "key": "k", "state": "ready"}


def test_the_first_table_starts_a_lineage_and_needs_no_diff():
    pub = Published("t1")
    first = body(1, rep("r-1"))
    assert pub.publish(first, epoch=0) is None
    assert (first["table"], first["version"]) == ("t1", 1)


def test_a_change_goes_out_as_what_changed_since_the_version_before():
    pub = Published("t1")
    pub.publish(body(1, rep("r-1"), rep("r-2"), rep("r-3")), epoch=0)
    d = pub.publish(body(2, rep("r-1"), rep("r-2", "http://n2:8100"), rep("r-4")), epoch=0)
    assert (d["table"], d["version"], d["base"], d["seq"]) == ("t1", 2, 1, 2)
    assert [r["id"] for r in d["replicas"]] == ["r-2", "r-4"]
    assert d["removed"] == ["r-3"] and "models" not in d


def test_a_snapshot_with_no_change_is_an_empty_diff_that_still_counts_a_version():
    pub = Published("t1")
    pub.publish(body(1, rep("r-1"), models=[{"name": "m"}]), epoch=0)
    d = pub.publish(body(1, rep("r-1"), models=[{"name": "m"}]), epoch=0)
    assert (d["base"], d["version"], d["replicas"], d["removed"]) == (1, 2, [], [])
    assert "models" not in d
    d = pub.publish(body(1, rep("r-1"), models=[{"name": "m", "state": "parked"}]), epoch=0)
    assert d["models"] == [{"name": "m", "state": "parked"}]


def test_a_new_epoch_starts_a_new_lineage_that_no_router_can_chain_to():
    pub = Published("t1")
    pub.publish(body(1, rep("r-1")), epoch=3)
    pub.publish(body(2, rep("r-1")), epoch=3)
    taken_over = body(1, rep("r-1"))
    assert pub.publish(taken_over, epoch=4) is None
    assert taken_over["table"] != "t1" and taken_over["version"] == 1
