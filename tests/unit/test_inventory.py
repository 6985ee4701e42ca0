"""The inventory's indexes by node and by model stay the truth as agents report."""

from llmgw_scheduler.inventory import Inventory


def shard(rid, model="m", state="ready"):
    return {"id": rid, "model": model, "state": state, "endpoint": f"http://x/{rid}"}


def ids(replicas):
    return sorted(r.id for r in replicas)


def test_replicas_are_found_by_node_and_by_model_until_they_end():
    inv = Inventory()
    inv.shard_update("a", shard("r1"), 0)
    inv.shard_update("a", shard("r2", model="n"), 0)
    inv.shard_update("b", shard("r3"), 0)
    assert (ids(inv.on_node("a")), ids(inv.of_model("m"))) == (["r1", "r2"], ["r1", "r3"])
    inv.shard_update("a", shard("r1", state="failed"), 1)
    assert (ids(inv.on_node("a")), ids(inv.of_model("m"))) == (["r2"], ["r3"])
    assert inv.of_model("nope") == [] and "r1" not in inv.replicas


def test_a_replica_missing_from_its_nodes_heartbeat_leaves_both_indexes():
    inv = Inventory()
    inv.shard_update("a", shard("r1"), 0)
    inv.shard_update("a", shard("r2"), 0)
    changed, vanished = inv.shards_report("a", [shard("r2")], 1, grace_s=10)
    assert changed and ids(vanished) == ["r1"]
    assert ids(inv.on_node("a")) == ids(inv.of_model("m")) == ["r2"]


def test_a_lost_node_is_known_lost_until_it_reports_again():
    inv = Inventory()
    inv.node_report("a", {}, 0)
    inv.shard_update("a", shard("r1"), 0)
    assert [n.id for n in inv.mark_lost(20, 10)] == ["a"]
    assert inv.lost_nodes() == {"a"} and inv.replicas["r1"].orphaned
    assert inv.state_of(inv.replicas["r1"]) == "lost"
    inv.node_report("a", {}, 21)
    assert inv.lost_nodes() == set()
