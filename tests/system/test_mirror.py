"""The weights mirror with the real scheduler, agents and `llmgw`: pulled once from an
HTTPS source that counts downloads, served to registered nodes only, pinned, verified,
and not removed while in use."""

import hashlib
import json
import os

import requests

from llmgw import mirror
from llmgw.store import ClusterSecret, open_store
from tests.helpers import eventually
from tests.system.conftest import GiB


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def node_token(cluster, node: str) -> str:
    open_store(os.environ["LLMGW_STORE"])  # the one every process of the test uses
    secret = ClusterSecret.get(ClusterSecret.name == "engine_keys").value
    return mirror.node_token(secret, node)


def blob(cluster, digest: str, node: str, token: str) -> requests.Response:
    return requests.get(
        f"http://127.0.0.1:{cluster.admin_port}/v1/mirror/blobs/{digest}",
        headers={"Authorization": f"Bearer {token}", "X-Llmgw-Node": node}, timeout=5,
    )  # fmt: skip


def test_one_pull_serves_two_agents_and_the_source_sees_one_download(cluster, source):
    url, data = source.url("m.gguf"), source.data
    cluster.add_model("m", memory=GiB, min_=2, max_=2, source=url, sha256=sha(data))
    cluster.scheduler_env = {"REQUESTS_CA_BUNDLE": str(source.ca_file)}
    cluster.start_scheduler()
    pulled = json.loads(ok(cluster.ctl("weights", "pull", "m", "--json")))
    assert [(p["model"], p["sha256"], p["size"], p["new"]) for p in pulled] == [
        ("m", sha(data), len(data), True)]  # fmt: skip
    again = cluster.ctl("weights", "pull", "m")
    assert again.returncode == 0 and "up to date" in again.stderr
    assert source.count("m.gguf") == 1

    for name in ("node-a", "node-b"):  # each fits one replica
        cluster.start_agent(name, memory=GiB * 3 // 2)
    eventually(lambda: [r["state"] for r in cluster.admin("/v1/replicas")] == ["ready"] * 2,
               timeout=30, what="a ready replica on each node")  # fmt: skip
    for name in ("node-a", "node-b"):
        got = cluster.tmp / f"agent-{name}" / "weights" / "sha256" / sha(data) / "m.gguf"
        assert got.read_bytes() == data
    assert source.count("m.gguf") == 1

    (listed,) = json.loads(ok(cluster.ctl("weights", "list", "--json")))
    assert (listed["state"], listed["sha256"], listed["replicas"]) == ("mirrored", sha(data), 2)
    nodes = json.loads(ok(cluster.ctl("nodes", "--json")))
    assert all(n["version"] and n["disk_free"] and n["disk_total"] for n in nodes)
    refused = cluster.ctl("weights", "rm", "m")
    assert refused.returncode == 1 and "in use by 2 replica(s)" in refused.stderr
    actions = [e["action"] for e in cluster.admin("/v1/audit?action=weights")]
    assert actions == ["weights.pull"]


def test_the_mirror_serves_registered_nodes_only_with_ranges(cluster, source):
    data = source.data
    cluster.add_model("m", memory=GiB, source=source.url("m.gguf"), sha256=sha(data))
    cluster.scheduler_env = {"REQUESTS_CA_BUNDLE": str(source.ca_file)}
    cluster.start_scheduler()
    ok(cluster.ctl("weights", "pull", "m"))
    ok(cluster.ctl("nodes", "add", "node-a"))
    token = node_token(cluster, "node-a")
    whole = blob(cluster, sha(data), "node-a", token)
    assert whole.status_code == 200 and whole.content == data
    part = requests.get(
        f"http://127.0.0.1:{cluster.admin_port}/v1/mirror/blobs/{sha(data)}",
        headers={"Authorization": f"Bearer {token}", "X-Llmgw-Node": "node-a",
                 "Range": "bytes=1000-"}, timeout=5,
    )  # fmt: skip
    assert part.status_code == 206 and part.content == data[1000:]
    assert part.headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    assert blob(cluster, sha(data), "node-a", "wrong").status_code == 401
    assert blob(cluster, sha(data), "node-x", node_token(cluster, "node-x")).status_code == 401
    # An operator's token is not a node's.
    admin = (cluster.etc / "secrets" / "admin.token").read_text().strip()
    assert blob(cluster, sha(data), "node-a", admin).status_code == 401
    ok(cluster.ctl("nodes", "remove", "node-a"))
    assert blob(cluster, sha(data), "node-a", token).status_code == 401


def test_a_source_without_sha256_is_pinned_and_a_change_upstream_is_refused(cluster):
    weights = cluster.tmp / "pinned.gguf"
    weights.write_bytes(b"GGUF first")
    cluster.add_model("p", memory=GiB, source=str(weights))
    cluster.start_scheduler()
    (first,) = json.loads(ok(cluster.ctl("weights", "pull", "p", "--json")))
    assert first["sha256"] == sha(b"GGUF first") and first["pinned_at"]
    weights.write_bytes(b"GGUF second")
    refused = cluster.ctl("weights", "pull", "p")
    assert refused.returncode == 1
    assert sha(b"GGUF first") in refused.stderr and sha(b"GGUF second") in refused.stderr
    (still,) = json.loads(ok(cluster.ctl("weights", "list", "--json")))
    assert still["sha256"] == sha(b"GGUF first")
    # The operator takes the new content on purpose: remove, pull, pinned afresh.
    removed = json.loads(ok(cluster.ctl("weights", "rm", "p", "--json")))
    assert removed["freed"] == len(b"GGUF first")
    (second,) = json.loads(ok(cluster.ctl("weights", "pull", "p", "--json")))
    assert second["sha256"] == sha(b"GGUF second")


def test_verify_finds_a_corrupt_blob_and_deletes_it(cluster):
    d = cluster.tmp / "split"
    d.mkdir()
    parts = {f"x-0000{i}-of-00002.gguf": os.urandom(1000) for i in (1, 2)}
    for name, data in parts.items():
        (d / name).write_bytes(data)
    cluster.add_model("s", memory=GiB, source=str(d / "x-00001-of-00002.gguf"))
    cluster.start_scheduler()
    (pulled,) = json.loads(ok(cluster.ctl("weights", "pull", "s", "--json")))
    assert sorted(f["name"] for f in pulled["files"]) == sorted(parts)
    assert pulled["sha256"] == mirror.content_id(mirror.files_from(pulled["files"]))
    assert ok(cluster.ctl("weights", "verify", "--all")).strip() == "s: ok"
    bad = sha(parts["x-00002-of-00002.gguf"])
    stored = cluster.tmp / "scheduler-state" / "mirror" / "blobs" / "sha256" / bad
    stored.write_bytes(b"rot")
    result = cluster.ctl("weights", "verify", "s")
    assert result.returncode == 1 and "x-00002-of-00002.gguf: corrupt" in result.stdout
    assert not stored.exists()
