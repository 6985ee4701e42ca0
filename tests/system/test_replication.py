"""Two schedulers on PostgreSQL, each with its own state directory, as two machines with
a disk each: what the leader pulls into the mirror and publishes as a release is copied
to the standby, so after the leader is killed the new one serves both, with nothing
copied by hand."""

import hashlib
import json
import signal

import requests

from tests.helpers import eventually
from tests.system.conftest import GiB
from tests.unit.test_releases import wheel_bytes

MISSING = 'llmgw_mirror_replication_missing_blobs{scheduler="%s"}'
COPIED = 'llmgw_mirror_replication_copied_total{scheduler="%s"}'


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def role(cluster, name) -> str:
    try:
        return cluster.admin("/v1/status", scheduler=name)["control_plane"]["role"]
    except Exception:
        return "down"


def test_after_the_leader_is_killed_the_standby_serves_every_mirrored_weight_and_release(
    cluster, pg_store, source
):
    data = source.data
    cluster.add_scheduler("s2")
    cluster.add_model("m", memory=GiB, source=source.url("m.gguf"), sha256=sha(data))
    cluster.scheduler_env = {"REQUESTS_CA_BUNDLE": str(source.ca_file)}
    cluster.scheduler_extra = "replicate_s = 0.5\nreplicate_backoff_max_s = 2.0\n"
    cluster.start_scheduler("s1")
    eventually(lambda: role(cluster, "s1") == "leader", what="s1 to lead")
    cluster.start_scheduler("s2")
    ok(cluster.ctl("weights", "pull", "m"))
    wheel = cluster.tmp / "llmgw-0.3.0-py3-none-any.whl"
    wheel.write_bytes(wheel_bytes("0.3.0"))
    ok(cluster.ctl("release", "publish", str(wheel)))

    # s2 copies both from s1 over s1's admin API, into its own state directory.
    def s2_whole() -> bool:
        copied = cluster.metric(COPIED % "s2", scheduler="s2")
        return copied == 2 and cluster.metric(MISSING % "s2", scheduler="s2", default=None) == 0

    eventually(s2_whole, timeout=30, what="s2 to hold every blob and release")
    s1_state, s2_state = cluster.tmp / "scheduler-state", cluster.tmp / "scheduler-state-s2"
    for state in (s1_state, s2_state):
        assert (state / "mirror" / "blobs" / "sha256" / sha(data)).read_bytes() == data
        assert (state / "releases" / wheel.name).read_bytes() == wheel.read_bytes()
    assert "mirror_dir" not in (cluster.tmp / "scheduler-s2.toml").read_text()  # the default
    # `llmgw status` through either scheduler says the standby's copy is whole.
    line = ok(cluster.ctl("status", scheduler="s2")).splitlines()
    assert any("STANDBY s2 (" in x and "mirror copied" in x for x in line), line

    cluster.schedulers["s1"].p.send_signal(signal.SIGKILL)
    eventually(lambda: role(cluster, "s2") == "leader", timeout=15, what="s2 to lead")

    # An agent that joins now is told to fetch from s2, and gets the weights from it.
    cluster.start_agent("node-a", memory=2 * GiB)
    eventually(
        lambda: [r["state"] for r in cluster.admin("/v1/replicas", scheduler="s2")] == ["ready"],
        timeout=30, what="a ready replica placed by s2",
    )  # fmt: skip
    got = cluster.tmp / "agent-node-a" / "weights" / "sha256" / sha(data) / "m.gguf"
    assert got.read_bytes() == data
    assert source.count("m.gguf") == 1  # pulled once from the source, ever
    assert "blob_not_found" not in cluster.agents["node-a"].log()

    # The release is downloadable from s2, and listed as held there.
    token = (cluster.etc / "secrets" / "admin.token").read_text().strip()
    port = cluster.sched_ports["s2"]["admin"]
    r = requests.get(f"http://127.0.0.1:{port}/v1/releases/{wheel.name}",
                     headers={"Authorization": f"Bearer {token}"}, timeout=10)  # fmt: skip
    assert r.status_code == 200 and r.content == wheel.read_bytes()
    listed = json.loads(ok(cluster.ctl("release", "list", "--json", scheduler="s2")))
    assert [(x["version"], x["here"]) for x in listed] == [("0.3.0", True)]

    # And the mirror through s2 is whole and verifies clean.
    assert ok(cluster.ctl("weights", "verify", "--all", scheduler="s2")).strip() == "m: ok"
    (weights,) = json.loads(ok(cluster.ctl("weights", "list", "--json", scheduler="s2")))
    assert (weights["state"], weights["lacking"]) == ("mirrored", [])
    assert "weights_corrupt" not in cluster.schedulers["s2"].log()
