"""A node that joins with a token serves a model whose weights it fetched from the
control plane's mirror, not from the model's source: the second of the two ways a node
joins (the first, `llmgw nodes onboard`, is tests/system/test_onboard.py)."""

import hashlib
import json

from tests.helpers import BIN, Proc, eventually, free_range
from tests.system.conftest import GiB
from tests.system.test_join import NewNode, ok, token_for


def test_a_joined_node_serves_a_model_with_weights_from_the_mirror(tls_cluster, source, api_key):
    cluster = tls_cluster
    digest = hashlib.sha256(source.data).hexdigest()
    cluster.add_model("m", memory=GiB, source=source.url("m.gguf"), sha256=digest)
    cluster.scheduler_env = {"REQUESTS_CA_BUNDLE": str(source.ca_file)}
    cluster.start_scheduler()
    cluster.start_router(api_key[1])
    ok(cluster.ctl("weights", "pull", "m", "--json"))
    assert source.count("m.gguf") == 1

    t = token_for(cluster, "node-j")
    node = NewNode(cluster, "node-j")
    joined = node.join(t["url"], t["token"], t["ca_sha256"])
    assert joined.returncode == 0, joined.stderr
    lo, hi = free_range()
    with open(node.config, "a") as f:  # the [agent] table join wrote is the file's last
        f.write(f'heartbeat_s = 0.5\nmetrics_listen = "127.0.0.1:0"\nport_min = {lo}\n'
                f"port_max = {hi}\nmemory_bytes = {2 * GiB}\n" + cluster._engines())  # fmt: skip
    # The agent has no trust in the source's private CA: weights can only come from the
    # mirror, whose certificate the join brought.
    cluster.agents["node-j"] = Proc(
        [str(BIN / "llmgw-agentd"), "--config", str(node.config)],
        cluster.tmp / "agent-node-j.log",
    )
    eventually(lambda: cluster.serves("m"), timeout=60, what="model m served by node-j")
    (replica,) = cluster.admin("/v1/replicas")
    assert replica["node"] == "node-j"
    kept = node.state / "weights" / "sha256" / digest / "m.gguf"
    assert kept.read_bytes() == source.data
    assert source.count("m.gguf") == 1  # the node never went to the source
    (listed,) = json.loads(ok(cluster.ctl("weights", "list", "--json")))
    assert (listed["state"], listed["replicas"]) == ("mirrored", 1)
