"""The admin API's store-backed resources: API keys, bus peers, the audit log, and (in
tenancy_api.py) orgs, teams, projects, users, limits, budgets and usage.

These change the store, not the scheduler's state, so they take no scheduler lock:
a slow store delays only the operator's command, never a placement pass.
"""

import time
from pathlib import Path
from urllib.parse import parse_qs

from llmgw import apikeys, audit, log, peers, tenancy
from llmgw.errors import TenancyError
from llmgw.store import ApiKey
from llmgw_scheduler import onboarding_api, tenancy_api

_log = log.get("llmgw.scheduler.admin")


def get(h, parts: list[str], query: str) -> bool:
    """Answer a GET on keys, peers, the audit log or tenancy (tenancy_api.py); False if
    the path is not ours."""
    if tenancy_api.get(h, parts, query):
        return True
    q = {k: v[-1] for k, v in parse_qs(query).items()}
    if parts == ["v1", "keys"]:
        h._send(200, apikeys.listing(q.get("all") in ("1", "true"), time.time()))
    elif parts == ["v1", "peers"]:
        kind = q.get("kind", "agent")
        if kind not in peers.KINDS:
            h._error(400, "invalid_value", f"kind must be one of {', '.join(peers.KINDS)}")
        else:
            h._send(200, peers.listing(kind))
    elif parts == ["v1", "audit"]:
        try:
            limit = min(10_000, max(1, int(q.get("limit", 100))))
            since = float(q["since"]) if "since" in q else None
        except ValueError:
            h._error(400, "invalid_value", "limit and since must be numbers")
            return True
        h._send(200, audit.recent(limit, since, q.get("action")))
    else:
        return False
    return True


def post(h, parts: list[str]) -> bool:
    """Answer a POST that creates keys or peers, revokes keys or changes tenancy; False
    if not ours."""
    if tenancy_api.post(h, parts):
        return True
    if parts not in (["v1", "keys"], ["v1", "keys", "revoke"], ["v1", "peers"]):
        return False
    body = h._body()
    if body is None:
        return True
    if parts == ["v1", "keys"]:
        _create_key(h, body)
    elif parts == ["v1", "keys", "revoke"]:
        _revoke_keys(h, body)
    else:
        _add_peer(h, body)
    return True


def delete(h, parts: list[str], query: str) -> bool:
    """DELETE /v1/peers/NAME?kind=agent|router[&force=1]: revoke a peer's key; False if
    the path is not ours."""
    if len(parts) != 3 or parts[:2] != ["v1", "peers"]:
        return False
    q = {k: v[-1] for k, v in parse_qs(query).items()}
    name, kind = parts[2], q.get("kind", "agent")
    if kind not in peers.KINDS:
        h._error(400, "invalid_value", f"kind must be one of {', '.join(peers.KINDS)}")
        return True
    force = q.get("force") in ("1", "true")
    if kind == "agent" and not force:
        s = h.sched
        with s.lock:
            held = sorted(r.id for r in s.inv.replicas.values() if r.node == name)
        if held:
            h._error(409, "node_has_replicas", replicas_refusal(name, held))
            return True
    try:
        peer = peers.remove(Path(h.cfg.curve_dir()), name, kind)
    except peers.PeerError as e:
        h._error(404, "peer_not_found", str(e))
        return True
    # At once on this scheduler, not at its next refresh from the store (2 s); the other
    # scheduler learns it at its own.
    auth = getattr(h, "bus_auth", None)
    if auth is not None:
        auth.revoke(peer.public_key)
    if kind == "agent" and h.sched is not None:
        onboarding_api.forget(name)
        with h.sched.lock:  # forgotten: a node that joins later under this name is new
            if name in h.sched.drained:
                h.sched.undrain(name)
    h._change(f"{'nodes' if kind == 'agent' else 'routers'}.remove", name, force=force or None)
    h._send(200, peers.peer_json(peer))
    return True


def replicas_refusal(name: str, replicas: list[str]) -> str:
    """Why a node with replicas is not removed, and what to do instead."""
    return (
        f"node {name} still has {len(replicas)} replica(s) ({', '.join(replicas[:5])}):"
        f" drain it first (`llmgw drain {name}`), or pass --force to cut it off with them"
    )


def _create_key(h, body: dict) -> None:
    name = body.get("name")
    models = body.get("models", [])
    expires_in = body.get("expires_in")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        return h._error(400, "invalid_value", "name must be a non-empty string")
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        return h._error(400, "invalid_value", "models must be a list of model names")
    if expires_in is not None and (
        not isinstance(expires_in, int | float) or isinstance(expires_in, bool) or expires_in <= 0
    ):
        return h._error(400, "invalid_value", "expires_in must be a number of seconds > 0")
    try:
        user, project = tenancy.key_owner(body.get("user"), body.get("project"))
        band = tenancy.check_band(body.get("band"), h.cfg.router.bands if h.cfg else None)
    except TenancyError as e:
        status = 404 if e.kind == "not_found" else 400
        return h._error(status, f"tenancy_{e.kind}", str(e))
    now = time.time()
    row, secret = apikeys.create(name.strip(), models, expires_in, now, user, project, band)
    h._change("keys.create", row.id, name=row.name, models=models or None, expires_in=expires_in,
              user=user, project=project, band=band or None)  # fmt: skip
    h._send(201, {**apikeys.key_json(row, now), "secret": secret})


def _revoke_keys(h, body: dict) -> None:
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        return h._error(400, "invalid_value", "ids must be a non-empty list of key ids")
    missing = apikeys.revoke(ids, time.time())
    if missing:
        return h._error(
            404, "key_not_found", f"no such key: {', '.join(missing)} (see `llmgw keys list`)"
        )
    for key_id in ids:
        h._change("keys.revoke", key_id)
    now = time.time()
    rows = ApiKey.select().where(ApiKey.id.in_(ids))
    h._send(200, [apikeys.key_json(r, now) for r in rows])


def _add_peer(h, body: dict) -> None:
    name, kind = body.get("name"), body.get("kind")
    if not isinstance(name, str) or not isinstance(kind, str):
        return h._error(400, "invalid_value", "name and kind must be strings")
    keys_dir = Path(h.cfg.curve_dir())
    try:
        peer = peers.register(keys_dir, name, kind)
    except peers.PeerError as e:
        status = 409 if "registered" in str(e) else 400
        return h._error(status, "invalid_peer", str(e))
    out = peers.peer_json(peer)
    out["key_dir"] = str(keys_dir)
    if body.get("files") is True:
        out["files"] = peers.key_files(keys_dir, name)
    h._change(f"{'nodes' if kind == 'agent' else 'routers'}.add", name, files=body.get("files"))
    h._send(201, out)
