"""A GPU node's topology, from a real agent (with a fake nvidia-smi printing the 2×A100
capture) to `llmgw nodes` and `llmgw explain-placement` through a real scheduler."""

import json
import os
import sys

from tests.helpers import eventually
from tests.system.conftest import GiB
from tests.unit.test_topology import FIX


def fake_nvidia_smi(bindir) -> str:
    bindir.mkdir()
    script = bindir / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"box = {str(FIX / 'a100-nvlink-pair')!r}\n"
        "if sys.argv[1].startswith('--query-gpu=index,name,'):\n"
        "    print('0, NVIDIA A100-SXM4-80GB, 81920, 81916')\n"
        "    print('1, NVIDIA A100-SXM4-80GB, 81920, 81916')\n"
        "    sys.exit(0)\n"
        "ext = 'topo.txt' if sys.argv[1:3] == ['topo', '-m'] else 'health.csv'\n"
        "sys.stdout.write(open(box + '.' + ext).read())\n"
    )
    script.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


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
