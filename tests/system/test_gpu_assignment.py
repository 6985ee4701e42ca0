"""Two GPU replicas on one node with two GPUs over PCIe (a fake nvidia-smi serving the
recorded pcie-2gpu box: two L40S, no NVLink), from a real scheduler and agent: each
engine is started with its own CUDA_VISIBLE_DEVICES, and an agent restart adopts both
keeping the mapping, which a restarted scheduler learns again."""

import json
import signal
import time
from pathlib import Path

from tests import fake_smi
from tests.helpers import eventually
from tests.system.conftest import GiB

BOX = "pcie-2gpu"
UUIDS = {line.split(", ")[1] for line in fake_smi.recorded(BOX)}


def visible_devices(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for entry in env:
        if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
            return entry.partition(b"=")[2].decode()
    return None


def test_two_gpu_replicas_get_different_gpus_and_keep_them_across_an_agent_restart(
    cluster, tmp_path
):
    cluster.add_model("g", memory=GiB, min_=2, max_=2, profile="gpus = 1\n")
    cluster.start_scheduler()
    path = fake_smi.write(tmp_path / "bin", BOX, fake_smi.RECORDED)
    cluster.start_agent("gpu-a", memory=4 * GiB, env={"PATH": path})

    def both_ready():
        replicas = cluster.admin("/v1/replicas")
        return len(replicas) == 2 and all(r["state"] == "ready" for r in replicas)

    eventually(both_ready, timeout=30, what="two ready replicas")
    shards = {s["id"]: s for s in cluster.shards("gpu-a")}
    seen = {rid: visible_devices(s["pid"]) for rid, s in shards.items()}
    # nvidia-smi said both GPUs were free throughout: only the booking kept them apart.
    assert set(seen.values()) == UUIDS, seen
    assert {rid: s["gpus"] for rid, s in shards.items()} == {r: [u] for r, u in seen.items()}
    replicas = {r["id"]: r["gpus"] for r in cluster.admin("/v1/replicas")}
    assert replicas == {r: [u] for r, u in seen.items()}
    gpus = json.loads(cluster.ctl("nodes", "--gpus", "--json").stdout)
    assert {g["uuid"]: g["replica"] for g in gpus} == {u: r for r, u in seen.items()}

    engines = cluster.engine_pids()
    cluster.agents["gpu-a"].stop(signal.SIGKILL)
    cluster.scheduler.stop(signal.SIGKILL)
    cluster.start_agent("gpu-a", memory=4 * GiB, env={"PATH": path})
    eventually(lambda: cluster.agents["gpu-a"].log().count("shard_adopted") == 2,
               what="both engines adopted")  # fmt: skip
    cluster.start_scheduler()

    def relearned():
        got = {r["id"]: r.get("gpus") for r in cluster.admin("/v1/replicas")}
        return got == {r: [u] for r, u in seen.items()}

    eventually(relearned, timeout=20, what="the new scheduler to learn each replica's GPU")
    deadline = time.monotonic() + 3  # a few passes: nothing may start a third engine
    while time.monotonic() < deadline:
        assert cluster.engine_pids() == engines
    assert {s["id"]: s["gpus"] for s in cluster.shards("gpu-a")} == {
        r: [u] for r, u in seen.items()}  # fmt: skip
    body = json.loads(cluster.ctl("explain-placement", "g", "--json").stdout)
    (node,) = body["nodes"]
    assert {g["why_not"] for g in node["gpus"]} == {f"assigned to {r}" for r in seen}
