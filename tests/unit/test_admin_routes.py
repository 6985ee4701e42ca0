"""The admin API's route table, walked route by route against the real server (HTTPS
with a cluster CA, as joining needs) in front of the real scheduler in process.

The walk iterates `routes.ROUTES` itself, so a route added tomorrow is walked too. Every
handler is wrapped to note that it ran: a refusal must come from the dispatcher, before
any handler sees the request.
"""

import dataclasses
import inspect
import ipaddress
import json
import ssl
import time
from datetime import UTC, datetime

import pytest
import requests
from cryptography import x509

from llmgw import jointokens, lease, mirror, operators
from llmgw.store import BusPeer, MirroredWeights, PublishedRelease
from llmgw_certmon import certs
from llmgw_scheduler import admin
from llmgw_scheduler.routes import NOT_OPERATORS, ROUTES, Access, Route, match
from tests.fake_fleet import Fleet, model

TOKEN = "t" * 32
PUBLIC_KEY = "A" * 40  # the shape of a CURVE public key; nothing is encrypted with it
# What a caller with no credential gets on each kind of route. A join's credential is
# the join token in the body: without a good one it is 403 with the reason, as ever.
# The page's 401 is HTML, for a browser.
UNCREDENTIALED = {
    Access.PAGE: (401, None),
    Access.READ: (401, "unauthorized"),
    Access.ADMIN: (401, "unauthorized"),
    Access.NODE: (401, "unauthorized"),
    Access.PEER: (401, "unauthorized"),
    Access.JOIN: (403, "join_refused"),
}
# Changes that write nothing to the audit log, each for a reason.
UNAUDITED = {"POST /v1/fabric/test"}  # a measurement: it changes nothing


def path_of(route: Route) -> str:
    return "/" + "/".join("x" if s.startswith("{") else s for s in route.segments)


@pytest.fixture
def api(tmp_path):
    """call(route or (method, path), token=..., headers=..., body=...) -> (response,
    the routes whose handlers ran)."""
    fleet = Fleet(tmp_path, [model("m")])
    cfg = fleet.cfg
    cfg.paths.config_dir, cfg.paths.state_dir = str(tmp_path / "etc"), str(tmp_path / "state")
    ca_pem, server_pem, key_pem = _pki(tmp_path / "etc" / "pki")
    cfg.scheduler.admin_tls_cert = str(server_pem)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(server_pem, key_pem)
    reached: list[str] = []
    table = tuple(dataclasses.replace(r, handler=_watched(r, reached)) for r in ROUTES)
    server = admin.serve(fleet.sched, "127.0.0.1:0", TOKEN, ssl_context=tls, cfg=cfg,
                         table=table)  # fmt: skip
    port = server.server_address[1]

    def call(route, token=None, headers=None, body=None):
        method, path = (route.method, path_of(route)) if isinstance(route, Route) else route
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        if body is None and method != "GET":
            body = {"public_key": PUBLIC_KEY, "token": ""} if path == "/v1/join" else {}
        reached.clear()
        resp = requests.request(method, f"https://127.0.0.1:{port}{path}", json=body,
                                headers=sent, verify=ca_pem, timeout=10,
                                allow_redirects=False)  # fmt: skip
        return resp, list(reached)

    call.fleet = fleet
    yield call
    server.shutdown()
    server.server_close()
    fleet.close()


def _watched(route: Route, reached: list[str]):
    def handler(h, **params):
        reached.append(str(route))
        return route.handler(h, **params)

    return handler


def _pki(pki):
    pki.mkdir(parents=True)
    now = datetime.now(UTC)
    ca = certs.make_ca("test CA", 1, now)
    ca_key = certs.load_key(ca.key_pem, "ca")
    server = certs.issue("admin", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], 1, now,
                         ca_key, ca.cert)  # fmt: skip
    for name, data in (("ca.crt", ca.cert_pem), ("admin.crt", server.cert_pem),
                       ("admin.key", server.key_pem)):  # fmt: skip
        (pki / name).write_bytes(data)
    return pki / "ca.crt", pki / "admin.crt", pki / "admin.key"


def _reader() -> str:
    return operators.create("grafana", operators.READ)[1]


def _error_code(resp) -> str | None:
    return resp.json()["error"]["code"] if "json" in resp.headers["Content-Type"] else None


# -- the table ---------------------------------------------------------------------------


def test_no_two_routes_answer_the_same_method_and_path():
    seen = [(r.method, r.path) for r in ROUTES]
    assert len(seen) == len(set(seen))
    for i, a in enumerate(ROUTES):
        for b in ROUTES[i + 1 :]:
            overlap = (
                a.method == b.method
                and len(a.segments) == len(b.segments)
                and all(
                    x == y or x.startswith("{") or y.startswith("{")
                    for x, y in zip(a.segments, b.segments, strict=True)
                )
            )
            assert not overlap, f"{a} and {b} can both match one path"


def test_every_handler_takes_exactly_its_routes_path_parameters():
    for r in ROUTES:
        params = {s[1:-1]: "x" for s in r.segments if s.startswith("{")}
        inspect.signature(r.handler).bind(None, **params)  # TypeError names the route


def test_every_kind_of_access_has_a_check():
    assert set(admin.AUTHENTICATE) == set(Access)


def test_every_change_declares_the_audit_action_it_writes():
    changes = {str(r) for r in ROUTES if r.access is Access.ADMIN and not r.audit}
    assert changes == UNAUDITED


def test_only_the_join_routes_the_mirror_and_replication_are_open_to_non_operators():
    assert {str(r) for r in ROUTES if r.access in NOT_OPERATORS} == {
        "GET /v1/join/ca",
        "POST /v1/join",
        "GET /v1/mirror/blobs/{sha256}",
        "GET /v1/replication/blobs/{sha256}",
        "GET /v1/replication/releases/{filename}",
    }


def test_only_signing_on_and_off_is_open_to_anyone_on_the_way_to_a_session():
    assert {str(r) for r in ROUTES if r.access is Access.SIGNON} == {
        "GET /login",
        "GET /oidc/callback",
        "POST /logout",
        "GET /v1/signon",
    }


def test_every_route_but_a_read_and_the_join_is_an_admins_and_needs_the_leader():
    own = {"POST /v1/admin-token/rotate", "POST /v1/scheduler-key/rotate"}  # each its own
    for r in ROUTES:
        if r.method == "GET":
            assert not r.leader and r.access is not Access.ADMIN, r
        elif r.access not in (Access.JOIN, Access.SIGNON):
            assert (r.access, r.leader) == (Access.ADMIN, str(r) not in own), r


# -- the walk ------------------------------------------------------------------------------


def walk(api, expect, **how) -> list[str]:
    """Every route `expect(route)` says something of ((status, reached) or None), asked as
    `how` says: the routes that answered otherwise, with what they answered."""
    wrong = []
    for route in ROUTES:
        want = expect(route)
        if want is None:
            continue
        resp, reached = api(route, **how)
        got = (resp.status_code, _error_code(resp), reached)
        if got != want:
            wrong.append(f"{route}: {got}, not {want}")
    return wrong


def test_a_caller_without_a_credential_is_refused_on_every_route_but_the_public_one(api):
    def refused(route):
        if route.access in (Access.PUBLIC, Access.SIGNON):
            return None
        return *UNCREDENTIALED[route.access], []

    assert walk(api, refused) == []


def test_a_wrong_token_is_refused_on_every_route_that_takes_an_operators(api):
    def refused(route):
        if route.access in (Access.READ, Access.ADMIN):
            return 401, "unauthorized", []
        return (401, None, []) if route.access is Access.PAGE else None

    assert walk(api, refused, token="wrong") == []


def test_a_read_operator_is_refused_every_change_before_its_handler(api):
    def refused(route):
        return (403, "forbidden", []) if route.access is Access.ADMIN else None

    assert walk(api, refused, token=_reader()) == []


def test_a_read_operator_reaches_every_read(api):
    reader = _reader()
    for route in ROUTES:
        if route.access in (Access.READ, Access.PAGE, Access.PUBLIC, Access.SIGNON):
            assert api(route, token=reader)[1] == [str(route)], route


def test_an_operators_token_does_not_open_the_mirror_replication_or_a_join(api):
    def refused(route):
        if route.access in (Access.NODE, Access.PEER, Access.JOIN):
            return *UNCREDENTIALED[route.access], []
        return None

    for token in (TOKEN, _reader()):
        assert walk(api, refused, token=token) == []


def test_a_registered_nodes_own_token_opens_the_mirror_and_no_other_nodes_does(api):
    BusPeer.create(name="node-a", kind="agent", public_key=PUBLIC_KEY, created_at=time.time())
    [blobs] = [r for r in ROUTES if r.access is Access.NODE]
    secret = api.fleet.sched.commands.cluster_secret

    def as_node(name: str, token_of: str):
        headers = {"X-Llmgw-Node": name}
        return api(blobs, token=mirror.node_token(secret, token_of), headers=headers)

    assert as_node("node-a", "node-b")[0].status_code == 401
    assert as_node("node-b", "node-b")[0].status_code == 401  # not registered
    resp, reached = as_node("node-a", "node-a")
    assert (resp.status_code, _error_code(resp), reached) == (404, "blob_not_found", [str(blobs)])


def test_a_blob_or_release_the_store_names_but_this_scheduler_lacks_is_503_with_retry_after(api):
    BusPeer.create(name="node-a", kind="agent", public_key=PUBLIC_KEY, created_at=time.time())
    secret = api.fleet.sched.commands.cluster_secret
    digest = "b" * 64
    MirroredWeights.create(model="m", source="x", sha256=digest, size=3, pinned_at=1,
                           pulled_at=1, files=json.dumps([{"name": "m.gguf", "sha256": digest,
                                                            "size": 3}]))  # fmt: skip
    headers = {"X-Llmgw-Node": "node-a"}
    resp, _ = api(("GET", f"/v1/mirror/blobs/{digest}"), headers=headers,
                  token=mirror.node_token(secret, "node-a"))  # fmt: skip
    assert (resp.status_code, _error_code(resp)) == (503, "blob_replicating")
    assert int(resp.headers["Retry-After"]) > 0
    other = "c" * 64  # named by no manifest: not found, as before
    resp, _ = api(("GET", f"/v1/mirror/blobs/{other}"), headers=headers,
                  token=mirror.node_token(secret, "node-a"))  # fmt: skip
    assert (resp.status_code, _error_code(resp)) == (404, "blob_not_found")
    wheel = "llmgw-0.3.0-py3-none-any.whl"
    PublishedRelease.create(filename=wheel, version="0.3.0", sha256="d" * 64, size=9,
                            published_at=1.0)  # fmt: skip
    resp, _ = api(("GET", f"/v1/releases/{wheel}"), token=TOKEN)
    assert (resp.status_code, _error_code(resp)) == (503, "release_replicating")
    assert int(resp.headers["Retry-After"]) > 0
    listed, _ = api(("GET", "/v1/releases"), token=TOKEN)
    assert [(r["version"], r["here"]) for r in listed.json()] == [("0.3.0", False)]


def test_a_known_schedulers_own_token_opens_replication_and_no_nodes_or_other_token_does(api):
    BusPeer.create(name="s2", kind="agent", public_key=PUBLIC_KEY, created_at=time.time())
    paths = {"GET /v1/replication/blobs/{sha256}": "/v1/replication/blobs/" + "a" * 64,
             "GET /v1/replication/releases/{filename}":
                 "/v1/replication/releases/llmgw-9.9.9-py3-none-any.whl"}  # fmt: skip
    assert set(paths) == {str(r) for r in ROUTES if r.access is Access.PEER}
    [blobs] = [r for r in ROUTES if r.access is Access.NODE]
    secret = api.fleet.sched.commands.cluster_secret

    def as_scheduler(path: str, name: str, token: str):
        return api(("GET", path), token=token, headers={"X-Llmgw-Scheduler": name})

    for path in paths.values():  # not a scheduler the store knows yet
        assert as_scheduler(path, "s2", mirror.peer_token(secret, "s2"))[0].status_code == 401
    lease.seen(api.fleet.db, "s2", "s2/h/1/x", "standby", "http://s2")
    for route, path in paths.items():
        resp, reached = as_scheduler(path, "s2", mirror.peer_token(secret, "s2"))
        assert (resp.status_code, reached) == (404, [route]), route
        assert as_scheduler(path, "s2", mirror.peer_token(secret, "s3"))[0].status_code == 401
        assert as_scheduler(path, "s2", mirror.node_token(secret, "s2"))[0].status_code == 401
    # A scheduler's token is not a node's, even under the same name.
    resp = api(blobs, token=mirror.peer_token(secret, "s2"), headers={"X-Llmgw-Node": "s2"})[0]
    assert resp.status_code == 401


def test_a_join_token_opens_the_join_once(api):
    token = jointokens.create("node-j", 60, time.time())[1]
    body = {"token": token, "public_key": PUBLIC_KEY}
    resp, reached = api(("POST", "/v1/join"), body=body)
    assert (resp.status_code, resp.json()["name"], reached) == (201, "node-j", ["POST /v1/join"])
    resp, reached = api(("POST", "/v1/join"), body=body)
    assert (resp.status_code, _error_code(resp), reached) == (403, "join_token_used", [])


def test_a_standby_refuses_every_change_on_the_leader_before_any_handler(api):
    api.fleet.is_leading = False

    def refused(route):
        return (409, "not_leader", []) if route.leader else None

    assert walk(api, refused, token=TOKEN) == []


@pytest.mark.parametrize(
    "method, path", [("GET", "/v1/nope"), ("POST", "/v1/models/m/nope"), ("DELETE", "/v1"),
                     ("GET", "/v1/status/more"), ("PUT", "/v1/nope")],
)  # fmt: skip
def test_a_path_no_route_has_is_404_without_touching_any_handler(api, method, path):
    for token in (None, TOKEN):
        resp, reached = api((method, path), token=token)
        assert (resp.status_code, _error_code(resp), reached) == (404, "not_found", [])
        assert resp.json()["error"]["message"] == f"no such endpoint: {method} {path}"


def test_a_known_path_asked_with_another_method_is_405_naming_the_methods_it_takes(api):
    resp, reached = api(("PUT", "/v1/models"), token=TOKEN)
    assert (resp.status_code, _error_code(resp), reached) == (405, "method_not_allowed", [])
    assert resp.headers["Allow"] == "GET, POST"


def test_a_body_that_is_not_a_json_object_is_400_before_the_handler(api):
    for body in ([1, 2], "text"):
        resp, reached = api(("POST", "/v1/models"), token=TOKEN, body=body)
        assert (resp.status_code, _error_code(resp), reached) == (400, "invalid_json", [])


def test_the_matcher_hands_the_handler_its_path_parameters_unquoted():
    route, params = match(ROUTES, "GET", "/v1/nodes/a%2Fb/shards/r-1/logs",
                          ["v1", "nodes", "a/b", "shards", "r-1", "logs"])  # fmt: skip
    assert (route.path, params) == ("/v1/nodes/{node}/shards/{shard}/logs",
                                    {"node": "a/b", "shard": "r-1"})  # fmt: skip
