"""Who the bus lets in, as the operator sees it: refusals said once, on both sides, in
words that point at the keys; and `nodes remove` / `routers remove` revoking a key."""

import json
import shutil
import time

from llmgw import bus
from tests.helpers import BIN, Proc, eventually
from tests.system.conftest import GiB


def _curve(cluster):
    return cluster.etc / "pki" / "curve"


def test_an_unregistered_agent_is_refused_on_both_sides_once_and_never_called_unreachable(cluster):
    cluster.start_scheduler()
    bus.create_keypair(_curve(cluster), "stranger")  # a keypair, never registered
    agent = cluster.start_agent("stranger", memory=GiB, register=False)
    eventually(lambda: "scheduler_refused" in agent.log(), timeout=15,
               what="the agent to say it is refused")  # fmt: skip
    # Its socket is made afresh every 5 s and refused again: still one line each side.
    first = cluster.scheduler.log().count("peer_refused")
    eventually(lambda: agent.log().count("scheduler_reconnect") >= 2, timeout=20,
               what="the agent to try again twice")  # fmt: skip
    assert "key not registered (run `llmgw nodes add stranger` on the control plane" in agent.log()
    assert agent.log().count("scheduler_refused") == 1
    assert "scheduler_unreachable" not in agent.log()
    sched = cluster.scheduler.log()
    assert first == 1 and sched.count("peer_refused") == 1, sched
    public = bus.load_public(_curve(cluster), "stranger")
    line = next(x for x in sched.splitlines() if "peer_refused" in x)
    assert public[:8] in line and 'reason="key not registered"' in line, line
    assert "address=127.0.0.1" in line


def test_an_agent_with_another_nodes_key_is_told_so_once_and_the_scheduler_says_it_once(cluster):
    cluster.start_scheduler()
    cluster.register("gpu-03")
    curve = _curve(cluster)
    shutil.copy(curve / "gpu-03.key_secret", curve / "gpu-04.key_secret")  # the wrong file
    agent = cluster.start_agent("gpu-04", memory=GiB, register=False)
    eventually(lambda: "scheduler_refused" in agent.log(), timeout=15,
               what="the agent to hear it is refused")  # fmt: skip
    assert "this key is gpu-03's, but the agent calls itself gpu-04" in agent.log()
    # That nothing repeats can only be seen after a while: four heartbeats (0.5 s) more.
    time.sleep(2.0)
    sched = cluster.scheduler.log()
    assert sched.count("identity_mismatch") == 1, sched
    line = next(x for x in sched.splitlines() if "identity_mismatch" in x)
    assert "node=gpu-03" in line and "claimed=gpu-04" in line and "b'" not in line, line
    assert agent.log().count("scheduler_refused") == 1


def test_a_node_whose_replicas_cannot_drain_away_is_not_removed_without_force(served):
    cluster = served
    # node-b is too small for m: draining node-a moves nothing within the wait.
    result = cluster.ctl("nodes", "remove", "node-a", "--wait", "2")
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.strip().splitlines() if not x.startswith("draining")]
    assert "still has 1 replica(s) after 2s of draining" in line and "--force" in line
    assert "node-a" in [p["name"] for p in cluster.admin("/v1/peers?kind=agent")]

    result = cluster.ctl("nodes", "remove", "node-a", "--force")
    assert result.returncode == 0, result.stderr
    assert "node-a" not in [p["name"] for p in cluster.admin("/v1/peers?kind=agent")]
    # Its connection was authenticated before: its messages are refused from now on.
    agent = cluster.agents["node-a"]
    eventually(lambda: "key removed from the control plane" in agent.log(), timeout=10,
               what="node-a to hear it was removed")  # fmt: skip
    actions = [e["action"] for e in cluster.admin("/v1/audit")]
    assert "nodes.remove" in actions
    assert cluster.ctl("nodes", "remove", "node-a").returncode == 1  # gone already


def test_a_removed_router_is_refused_at_its_next_connection(served):
    cluster = served
    curve = _curve(cluster)
    # What the router's own machine keeps: the control plane's copy goes with the removal.
    kept = {f: (curve / f).read_bytes() for f in ("router.key", "router.key_secret")}
    result = cluster.ctl("routers", "remove", "router")
    assert result.returncode == 0, result.stderr
    assert cluster.admin("/v1/peers?kind=router") == []
    assert "routers.remove" in [e["action"] for e in cluster.admin("/v1/audit")]
    assert not (curve / "router.key_secret").exists()

    cluster.router.stop()
    # The router's own machine: its config dir with the keys it was given.
    own = cluster.tmp / "router-etc"
    (own / "pki" / "curve").mkdir(parents=True)
    for name, data in {**kept, "scheduler.key": (curve / "scheduler.key").read_bytes()}.items():
        (own / "pki" / "curve" / name).write_bytes(data)
    config = cluster.tmp / "router-2.toml"
    text = (cluster.tmp / "router.toml").read_text()
    config.write_text(text.replace(f'config_dir = "{cluster.etc}"', f'config_dir = "{own}"'))
    again = Proc([str(BIN / "llmgw-router"), "--config", str(config)],
                 cluster.tmp / "router-2.log")  # fmt: skip
    cluster.router = again  # stopped with the cluster
    eventually(lambda: "scheduler_refused" in again.log(), timeout=15,
               what="the restarted router to be refused")  # fmt: skip
    assert "key not registered" in again.log()
    assert "peer_refused" in cluster.scheduler.log()


def test_removing_a_node_drains_it_first_then_its_key_is_refused(cluster, api_key):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="model m to be served")
    cluster.start_agent("node-c", memory=2 * GiB)
    up = lambda: any(n["name"] == "node-c" and n["state"] == "up"  # noqa: E731
                     for n in cluster.admin("/v1/nodes"))  # fmt: skip
    eventually(up, timeout=20, what="node-c to say hello")
    result = cluster.ctl("nodes", "remove", "node-a", "--wait", "60")
    assert result.returncode == 0, result.stderr
    assert "draining node-a" in result.stderr
    (r,) = cluster.admin("/v1/replicas")
    assert (r["node"], r["state"]) == ("node-c", "ready")
    assert cluster.serves("m")
    assert "node-a" not in [p["name"] for p in cluster.admin("/v1/peers?kind=agent")]
    eventually(lambda: "key removed from the control plane" in cluster.agents["node-a"].log(),
               timeout=10, what="node-a to hear it was removed")  # fmt: skip
    actions = [e["action"] for e in cluster.admin("/v1/audit")]
    assert actions.index("nodes.drain") < actions.index("nodes.remove")


def test_every_schedulers_copy_of_a_removed_keypair_is_deleted_and_a_new_add_makes_a_new_key(
    cluster, pg_store
):
    cluster.add_scheduler("s2", own_config_dir=True)  # a machine of its own, as install.md
    cluster.start_scheduler("s1")
    for name in ("gpu-07", "gpu-08"):
        cluster.register(name)
    cluster.register("edge-01", "routers")
    # The operator copies each keypair to the other control-plane machine too.
    etc2 = cluster.sched_etc["s2"]
    cluster.copy_control_plane_files(etc2, "gpu-07", "gpu-08", "edge-01")
    curve1, curve2 = _curve(cluster), etc2 / "pki" / "curve"
    old = bus.load_public(curve2, "gpu-08")
    cluster.start_scheduler("s2")
    eventually(lambda: cluster.admin("/v1/status", scheduler="s2")["control_plane"]["role"]
               == "standby", what="s2 to stand by")  # fmt: skip

    files = lambda d, n: sorted(p.name for p in d.glob(f"{n}.key*"))  # noqa: E731
    for args in (("nodes", "remove", "gpu-07", "--force"), ("routers", "remove", "edge-01")):
        result = cluster.ctl(*args)
        assert result.returncode == 0, result.stderr
        assert files(curve1, args[2]) == []  # the scheduler that removed it: at once
        eventually(lambda n=args[2]: files(curve2, n) == [], timeout=10,
                   what=f"s2 to delete its copy of {args[2]}'s keypair")  # fmt: skip
    assert "revoked_keypair_deleted peer=gpu-07" in cluster.schedulers["s2"].log()
    entry = [e for e in cluster.admin("/v1/audit") if e["target"] == "gpu-07"][-1]
    assert entry["detail"]["public_key"] and "secret" not in json.dumps(entry["detail"])

    # A scheduler that was down when the node was removed deletes its copy at its start.
    cluster.schedulers["s2"].stop()
    assert cluster.ctl("nodes", "remove", "gpu-08", "--force").returncode == 0
    assert files(curve2, "gpu-08") == ["gpu-08.key", "gpu-08.key_secret"]
    cluster.start_scheduler("s2")
    eventually(lambda: files(curve2, "gpu-08") == [], timeout=10,
               what="s2 to delete gpu-08's keypair at its start")  # fmt: skip

    # The name added again gets a new key; the old one is refused wherever it is kept.
    assert cluster.ctl("nodes", "add", "gpu-08").returncode == 0
    new = bus.load_public(curve1, "gpu-08")
    assert new != old
    assert [p["public_key"] for p in cluster.admin("/v1/peers?kind=agent")] == [new]
