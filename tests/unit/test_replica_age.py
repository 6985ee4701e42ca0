"""A replica's age is from when it was first known, not from its last state change."""

from llmgw_ctl.status import print_replicas
from llmgw_scheduler.inventory import Inventory


def test_a_replica_that_begins_draining_keeps_its_age(capsys):
    inv = Inventory()
    shard = {"id": "r-1", "model": "m", "profile": "p", "state": "starting"}
    inv.shard_update("node-a", shard, now=1000.0)
    inv.shard_update("node-a", {**shard, "state": "ready"}, now=1010.0)
    inv.shard_update("node-a", {**shard, "state": "draining"}, now=1600.0)
    r = inv.replicas["r-1"]
    assert (r.since, r.created) == (1600.0, 1000.0)

    row = {"id": "r-1", "model": "m", "node": "node-a", "state": "draining",
           "since": r.since, "created": r.created, "idle_s": None, "rss": 0}  # fmt: skip
    print_replicas([row], now=1601.0)
    out = capsys.readouterr().out
    assert "10m" in out and " 1s" not in out, out
