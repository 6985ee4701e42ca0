"""A GPU node's topology, from a real agent (with a fake nvidia-smi printing the 2×A100
capture) to `llmgw nodes` and `llmgw explain-placement` through a real scheduler."""

import json

from tests import fake_smi
from tests.helpers import eventually
from tests.system.conftest import GiB


def fake_nvidia_smi(bindir) -> str:
    return fake_smi.write(bindir)


def test_explain_placement_says_which_link_joins_a_tensor_parallel_group(cluster, tmp_path):
    # min 0: explained, never started (that would install vLLM).
    cluster.add_model("tp2", engine="vllm", version="0.10.1.1", memory=GiB, min_=0,
                      profile="gpus = 2\n")  # fmt: skip
    cluster.start_scheduler()
    cluster.start_agent("gpu-a", memory=8 * GiB, env={"PATH": fake_nvidia_smi(tmp_path / "bin")})
    cluster.start_agent("cpu-b", memory=8 * GiB)

    def both_reported():
        nodes = {n["name"]: n for n in cluster.admin("/v1/nodes")}
        return len(nodes) == 2 and all(n["state"] == "up" for n in nodes.values())

    eventually(both_reported, timeout=20, what="two nodes up")
    nodes = {n["name"]: n for n in json.loads(cluster.ctl("nodes", "--json").stdout)}
    assert nodes["gpu-a"]["topology"]["matrix"]["links"] == {"0-1": "NV12"}
    assert nodes["cpu-b"]["topology"]["matrix"] is None

    body = json.loads(cluster.ctl("explain-placement", "tp2", "--json").stdout)
    links = {n["name"]: n["gpu_link"] for n in body["nodes"]}
    assert links == {"gpu-a": "GPUs 0,1 joined by NV12 (nvlink)", "cpu-b": ""}
    text = cluster.ctl("explain-placement", "tp2").stdout
    assert "gpu-a: GPUs 0,1 joined by NV12 (nvlink)" in text.splitlines()
