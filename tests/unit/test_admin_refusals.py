"""The admin API's refusals: each status, code and message, from the real handler in
front of the real scheduler in process (a fake clock, agents that are only messages)."""

import pytest
import requests
from prometheus_client import REGISTRY

from llmgw_scheduler.admin import serve
from tests.fake_fleet import Fleet, model

TOKEN = "t" * 32


@pytest.fixture
def api(tmp_path):
    fleet = Fleet(tmp_path, [model("m")])
    fleet.heartbeat("a", kind="hello")
    server = serve(fleet.sched, "127.0.0.1:0", TOKEN)
    port = server.server_address[1]

    def call(method: str, path: str, body: dict | None = None):
        url = f"http://127.0.0.1:{port}{path}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        resp = requests.request(method, url, json=body, headers=auth, timeout=5)
        error = resp.json().get("error") if resp.status_code >= 400 else None
        return resp.status_code, error["code"] if error else None, error and error["message"]

    yield call
    server.shutdown()
    server.server_close()
    fleet.close()


@pytest.mark.parametrize(
    "method, path, body, status, code, message",
    [
        ("POST", "/v1/models/nope/scale", {"min": 1, "max": 1}, 404, "model_not_found",
         "no model 'nope'"),
        ("POST", "/v1/models/m/scale", {"min": 2, "max": 1}, 400, "invalid_value",
         "min 2 / max 1: want 0 <= min <= max, max >= 1"),
        ("POST", "/v1/models/nope/retry", None, 404, "model_not_found", "no model 'nope'"),
        ("GET", "/v1/models/nope/placement", None, 404, "model_not_found", "no model 'nope'"),
        ("DELETE", "/v1/models/m", None, 409, "defined_in_config",
         "model 'm' is defined in the config file: remove it there"),
        ("DELETE", "/v1/models/nope", None, 404, "model_not_found", "no runtime model 'nope'"),
        ("POST", "/v1/models", {"name": "m", "source": "/m.gguf"}, 409, "invalid_model",
         "model 'm' exists already"),
        ("POST", "/v1/models", {"name": "x"}, 400, "invalid_model", None),
        ("POST", "/v1/restarts", {"replicas": ["r-nope"]}, 404, "replica_not_found",
         "no running replica 'r-nope' (see `llmgw replicas`)"),
        ("POST", "/v1/restarts", {"model": "nope"}, 404, "model_not_found", "no model 'nope'"),
        ("POST", "/v1/nodes/nope/drain", None, 404, "node_not_found", "no node 'nope'"),
        ("POST", "/v1/nodes/nope/undrain", None, 404, "node_not_found", "no node 'nope'"),
        ("GET", "/v1/nodes/nope/shards/r-1/logs", None, 404, "node_not_found",
         "node 'nope' is not connected"),
        ("DELETE", "/v1/operators/nope", None, 404, "operator_not_found",
         "no operator 'nope' (see `llmgw operators list`)"),
        ("POST", "/v1/operators", {"name": "bob", "role": "god"}, 400, "invalid_operator",
         None),
    ],
)  # fmt: skip
def test_a_refused_request_is_answered_with_its_status_code_and_message(
    api, method, path, body, status, code, message
):
    got = api(method, path, body)
    assert got[:2] == (status, code), got
    if message is not None:
        assert got[2] == message


def test_an_operator_added_twice_is_a_conflict(api):
    assert api("POST", "/v1/operators", {"name": "bob", "role": "read"})[0] == 201
    assert api("POST", "/v1/operators", {"name": "bob", "role": "read"}) == (
        409, "invalid_operator", "operator 'bob' exists already",
    )  # fmt: skip


def test_a_change_that_is_allowed_is_still_answered_202(api):
    assert api("POST", "/v1/models/m/scale", {"min": 0, "max": 2})[:2] == (202, None)
    assert api("POST", "/v1/nodes/a/drain")[:2] == (202, None)
    assert api("POST", "/v1/models/m/retry")[:2] == (202, None)


def test_a_read_operators_refused_change_is_in_the_audit_log_and_a_bad_tokens_only_counted(
    tmp_path,
):
    fleet = Fleet(tmp_path, [model("m")])
    server = serve(fleet.sched, "127.0.0.1:0", TOKEN)
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def call(method, path, token, body=None):
        auth = {"Authorization": f"Bearer {token}", "X-Llmgw-Actor": "eve@laptop"}
        return requests.request(method, url + path, json=body, headers=auth, timeout=5)

    try:
        made = call("POST", "/v1/operators", TOKEN, {"name": "grafana", "role": "read"})
        reader = made.json()["token"]
        refused = call("POST", "/v1/models/m/scale", reader, {"min": 0, "max": 9})
        assert refused.status_code == 403
        assert call("DELETE", "/v1/peers/gpu-01?kind=agent", reader).status_code == 403
        entries = call("GET", "/v1/audit", TOKEN).json()
        assert [(e["action"], e["actor"], e["target"]) for e in entries] == [
            ("operators.add", "eve@laptop", "grafana"),  # the bootstrap token: its label
            ("models.scale_refused", "grafana", "m"),
            ("nodes.remove_refused", "grafana", "gpu-01"),
        ]
        assert entries[1]["detail"] == {
            "refused": "forbidden", "role": "read", "claimed": "eve@laptop",
            "request": "POST /v1/models/m/scale",
            "reason": "operator 'grafana' has the read role: changes need an admin token",
        }  # fmt: skip
        assert entries[1]["client"] == "127.0.0.1"
        assert fleet.sched.models["m"].max == 1  # and nothing changed

        counted = lambda: REGISTRY.get_sample_value(  # noqa: E731
            "llmgw_admin_unauthenticated_total", {"access": "admin"}
        ) or 0.0  # fmt: skip
        before = counted()
        for _ in range(3):
            assert call("POST", "/v1/models/m/scale", "wrong", {"min": 0}).status_code == 401
        assert counted() == before + 3
        assert len(call("GET", "/v1/audit", TOKEN).json()) == 3  # no row for a bad token
    finally:
        server.shutdown()
        server.server_close()
        fleet.close()
