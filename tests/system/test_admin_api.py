"""The scheduler's admin API, over HTTP with its bearer token."""

import requests

from tests.helpers import eventually


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
