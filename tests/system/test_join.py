"""Join tokens: `llmgw nodes join-token` and `llmgw-agentd join` against the real
scheduler on HTTPS with the cluster CA, then the joined agent on the bus."""

import json
import subprocess
import time

import pytest

from tests.helpers import BIN, Proc, eventually, free_range
from tests.system.test_tls import certmon


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


@pytest.fixture
def tls_cluster(tls_cluster):
    tls_cluster.start_scheduler()
    return tls_cluster


def token_for(cluster, name: str, ttl: str = "1h") -> dict:
    return json.loads(ok(cluster.ctl("nodes", "join-token", name, "--ttl", ttl, "--json")))


class NewNode:
    """A machine with nothing of llmgw on it but its config's paths."""

    def __init__(self, cluster, label: str):
        self.dir = cluster.tmp / label
        self.etc, self.state = self.dir / "etc", self.dir / "state"
        self.config = self.dir / "llmgw.toml"
        self.dir.mkdir()
        self.config.write_text(
            f'[paths]\nconfig_dir = "{self.etc}"\nstate_dir = "{self.state}"\n'
            '[log]\nlevel = "debug"\n'
        )

    def join(self, url: str, token: str, fp: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "llmgw-agentd"), "--config", str(self.config), "join", url, token,
             "--ca-sha256", fp],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip


def test_a_node_joins_with_a_token_once_and_its_agent_is_let_onto_the_bus(tls_cluster):
    cluster = tls_cluster
    t = token_for(cluster, "node-j")
    assert t["command"] == f"llmgw-agentd join {t['url']} {t['token']} --ca-sha256 {t['ca_sha256']}"
    node = NewNode(cluster, "node-j")
    joined = node.join(t["url"], t["token"], t["ca_sha256"])
    assert joined.returncode == 0, joined.stderr
    assert "joined as node-j" in joined.stderr
    curve = node.etc / "pki" / "curve"
    assert {p.name for p in curve.iterdir()} >= {"node-j.key", "node-j.key_secret", "scheduler.key"}
    # The secret key was made here and stays here: the scheduler has only the public one.
    assert not (cluster.etc / "pki" / "curve" / "node-j.key_secret").exists()
    assert (node.etc / "pki" / "ca.crt").read_text() == (cluster.etc / "pki" / "ca.crt").read_text()

    lo, hi = free_range()
    with open(node.config, "a") as f:  # the [agent] table join wrote is the file's last
        f.write(f'heartbeat_s = 0.5\nmetrics_listen = "127.0.0.1:0"\nport_min = {lo}\n'
                f"port_max = {hi}\n")  # fmt: skip
    agent = Proc([str(BIN / "llmgw-agentd"), "--config", str(node.config)],
                 cluster.tmp / "agent-node-j.log")  # fmt: skip
    cluster.agents["node-j"] = agent
    eventually(lambda: any(n["name"] == "node-j" and n["state"] == "up"
                           for n in cluster.admin("/v1/nodes")),
               timeout=30, what="node-j to say hello")  # fmt: skip

    again = NewNode(cluster, "again").join(t["url"], t["token"], t["ca_sha256"])
    assert again.returncode == 1
    (line,) = again.stderr.strip().splitlines()
    assert "used already" in line

    actions = [
        (e["action"], e["target"], e["actor"]) for e in cluster.admin("/v1/audit?action=nodes.join")
    ]
    assert actions[0][:2] == ("nodes.join_token", "node-j")
    assert ("nodes.join", "node-j", "join-token") in actions
    assert ("nodes.join_refused", "", "join-token") in actions
    assert all(t["token"] not in json.dumps(e) for e in cluster.admin("/v1/audit"))


def test_a_wrong_ca_fingerprint_is_refused_before_the_token_is_sent(tls_cluster):
    cluster = tls_cluster
    t = token_for(cluster, "node-k")
    (cluster.tmp / "other").mkdir()
    other = certmon(cluster.tmp / "other", "init-ca") / "ca.crt"
    import hashlib
    import ssl

    wrong = hashlib.sha256(ssl.PEM_cert_to_DER_cert(other.read_text())).hexdigest()
    node = NewNode(cluster, "node-k")
    refused = node.join(t["url"], t["token"], wrong)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "refusing to join" in line and wrong in line and t["ca_sha256"] in line
    assert not (node.etc / "pki" / "curve").exists()
    # The token never left the node: it still works, with the right fingerprint.
    assert node.join(t["url"], t["token"], t["ca_sha256"]).returncode == 0


def test_an_expired_token_is_refused_in_one_line(tls_cluster):
    cluster = tls_cluster
    t = token_for(cluster, "node-e", ttl="1s")
    eventually(lambda: time.time() > t["expires_at"] + 0.2, timeout=5, what="the token to expire")
    refused = NewNode(cluster, "node-e").join(t["url"], t["token"], t["ca_sha256"])
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "expired" in line
    assert not any(n["name"] == "node-e" for n in cluster.admin("/v1/nodes"))


def test_join_tokens_need_the_admin_api_on_https(cluster):
    cluster.start_scheduler()
    refused = cluster.ctl("nodes", "join-token", "node-x")
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "HTTPS" in line and "llmgw-certmon" in line
