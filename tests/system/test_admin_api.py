"""The scheduler's admin API, over HTTP with its bearer token."""

import json

import requests

from tests.helpers import eventually
from tests.system.conftest import GiB


def api(cluster, method, path, token=None):
    token = token or (cluster.etc / "secrets" / "admin.token").read_text().strip()
    return requests.request(
        method,
        f"http://127.0.0.1:{cluster.admin_port}{path}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    )


def test_status_shows_nodes_models_and_replicas_as_they_are(served):
    body = eventually(
        lambda: (
            (b := api(served, "GET", "/v1/status").json()) and b["models"][0]["ready"] == 1 and b
        ),
        what="a ready model",
    )
    (model,) = body["models"]
    assert (model["name"], model["state"], model["min"], model["ready"]) == ("m", "serving", 1, 1)
    assert {n["name"]: n["state"] for n in body["nodes"]} == {"node-a": "up", "node-b": "up"}
    (replica,) = body["replicas"]
    assert (replica["model"], replica["node"], replica["state"]) == ("m", "node-a", "ready")


def test_placement_is_explained_for_every_node(served):
    body = api(served, "GET", "/v1/models/m/placement").json()
    fits = {n["name"]: (n["fits"], n["reason"]) for n in body["nodes"]}
    assert fits["node-b"][0] is False and "GiB" in fits["node-b"][1]
    assert body["need"]["memory"] == 1 << 30


def test_the_api_refuses_a_wrong_token_and_names_unknown_models(served):
    assert api(served, "GET", "/v1/status", token="wrong").status_code == 401
    resp = api(served, "GET", "/v1/models/nope/placement")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert api(served, "POST", "/v1/models/nope/retry").status_code == 404


def test_a_retry_is_queued_and_answered_202(served):
    resp = api(served, "POST", "/v1/models/m/retry")
    assert resp.status_code == 202 and resp.json() == {"model": "m", "queued": "retry"}


def test_nodes_add_through_the_api_writes_a_keypair_an_agent_can_join_with(cluster, tmp_path):
    cluster.add_model("m")
    cluster.start_scheduler()
    out = tmp_path / "for-node-c"
    result = cluster.ctl("nodes", "add", "node-c", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    peer = json.loads(result.stdout)
    assert (peer["name"], peer["kind"]) == ("node-c", "agent") and "files" not in peer
    curve = cluster.etc / "pki" / "curve"
    for name in ("node-c.key_secret", "scheduler.key"):
        assert (out / name).read_text() == (curve / name).read_text()
        assert (out / name).stat().st_mode & 0o777 == 0o600
    # Registered again with the same key: fine; the audit log has both, with who and where.
    assert cluster.ctl("nodes", "add", "node-c").returncode == 0
    assert cluster.ctl("routers", "add", "node-c").returncode == 1  # a name is one kind
    entries = json.loads(cluster.ctl("audit", "--json").stdout)
    assert [(e["action"], e["target"], e["client"]) for e in entries] == [
        ("nodes.add", "node-c", "127.0.0.1"),
        ("nodes.add", "node-c", "127.0.0.1"),
    ]
    assert entries[0]["detail"] == {"files": True, "token": "bootstrap"}

    cluster.start_agent("node-c", memory=2 * GiB, register=False)
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 1, what="node-c to join")
