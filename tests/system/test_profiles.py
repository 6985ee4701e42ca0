"""A model with two profiles, the first needing more memory than the test node has, from
a real scheduler and agent with the fake engine: it starts with the second, the replica
says so (`llmgw replicas`, the admin API), and keeps saying so after the agent and the
scheduler restart."""

import json
import signal
import time

from tests.helpers import eventually
from tests.system.conftest import GiB


def test_a_model_starts_with_its_first_profile_that_fits_and_its_replica_records_it(cluster):
    weights = cluster.tmp / "weights.gguf"
    # The cluster writes the fake weights there with the config.
    cluster.models_toml += (
        f'[[models]]\nname = "p"\nsource = "{weights}"\nengine = "fake"\n'
        f'engine_version = "1"\n'
        f'[[models.profiles]]\nname = "big"\nmemory_bytes = {64 * GiB}\n'
        f'[[models.profiles]]\nname = "small"\nmemory_bytes = {GiB}\nparallel = 2\n'
    )
    cluster.start_scheduler()
    cluster.start_agent("a", memory=4 * GiB)

    def ready():
        rs = [r for r in cluster.admin("/v1/replicas") if r["model"] == "p"]
        return rs if len(rs) == 1 and rs[0]["state"] == "ready" else None

    (replica,) = eventually(ready, timeout=30, what="a ready replica of p")
    assert replica["profile"] == "small"
    listed = {r["id"]: r["profile"] for r in json.loads(cluster.ctl("replicas", "--json").stdout)}
    assert listed[replica["id"]] == "small"
    table = cluster.ctl("replicas", "--model", "p").stdout.splitlines()
    assert table[0].split()[:3] == ["ID", "MODEL", "PROFILE"]
    assert table[1].split()[:3] == [replica["id"], "p", "small"]
    (shard,) = [s for s in cluster.shards("a") if s["id"] == replica["id"]]
    assert shard["profile_name"] == "small"  # start_shard carried it to the agent

    engines = cluster.engine_pids()
    cluster.agents["a"].stop(signal.SIGKILL)
    cluster.scheduler.stop(signal.SIGKILL)
    cluster.start_agent("a", memory=4 * GiB)
    eventually(lambda: "shard_adopted" in cluster.agents["a"].log(), what="the engine adopted")
    cluster.start_scheduler()

    def relearned():
        got = {r["id"]: r["profile"] for r in cluster.admin("/v1/replicas")}
        return got.get(replica["id"]) == "small"

    eventually(relearned, timeout=20, what="the new scheduler to learn the replica's profile")
    deadline = time.monotonic() + 2  # a few passes: nothing may start another engine
    while time.monotonic() < deadline:
        assert cluster.engine_pids() == engines
