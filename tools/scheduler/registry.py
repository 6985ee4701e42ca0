"""The admin API's store-backed resources: API keys, bus peers and the audit log
(orgs, teams, projects, users, limits, budgets and usage are tenancy_api.py's).

These change the store, not the scheduler's state, so they take no scheduler lock:
a slow store delays only the operator's command, never a placement pass.
"""

import time
from pathlib import Path

from llmgw import apikeys, audit, peers, tenancy
from llmgw.errors import Conflict, Invalid, NotFound
from llmgw.store import ApiKey


def keys_list(h):
    return 200, apikeys.listing(h.q.get("all") in ("1", "true"), time.time())


def peers_list(h):
    return 200, peers.listing(_kind(h))


def _kind(h) -> str:
    kind = h.q.get("kind", "agent")
    if kind not in peers.KINDS:
        raise Invalid(f"kind must be one of {', '.join(peers.KINDS)}")
    return kind


def audit_list(h):
    q = h.q
    try:
        limit = min(10_000, max(1, int(q.get("limit", 100))))
        since = float(q["since"]) if "since" in q else None
    except ValueError:
        raise Invalid("limit and since must be numbers") from None
    return 200, audit.recent(limit, since, q.get("action"))


def peers_remove(h, name: str):
    """DELETE /v1/peers/NAME?kind=agent|router[&force=1]: revoke a peer's key."""
    kind = _kind(h)
    force = h.q.get("force") in ("1", "true")
    if kind == "agent" and not force:
        s = h.sched
        with s.lock:
            held = sorted(r.id for r in s.inv.replicas.values() if r.node == name)
        if held:
            raise Conflict(replicas_refusal(name, held), "node_has_replicas")
    try:
        peer = peers.remove(Path(h.cfg.curve_dir()), name, kind)
    except peers.PeerError as e:
        raise NotFound(str(e), "peer_not_found") from None
    # At once on this scheduler, not at its next refresh from the store (2 s); the other
    # scheduler learns it at its own.
    auth = getattr(h, "bus_auth", None)
    if auth is not None:
        auth.revoke(peer.public_key)
    if kind == "agent" and h.sched is not None:
        with h.sched.lock:  # forgotten: a node that joins later under this name is new
            h.sched.forget_node(name)
    h.audit(name, action=f"{_noun(kind)}.remove", force=force or None,
            **peers.removal_detail(peer))  # fmt: skip
    return 200, peers.peer_json(peer)


def _noun(kind: str) -> str:
    return "nodes" if kind == "agent" else "routers"


def replicas_refusal(name: str, replicas: list[str]) -> str:
    """Why a node with replicas is not removed, and what to do instead."""
    return (
        f"node {name} still has {len(replicas)} replica(s) ({', '.join(replicas[:5])}):"
        f" drain it first (`llmgw drain {name}`), or pass --force to cut it off with them"
    )


def keys_create(h):
    body = h.body
    name = body.get("name")
    models = body.get("models", [])
    expires_in = body.get("expires_in")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise Invalid("name must be a non-empty string")
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise Invalid("models must be a list of model names")
    if expires_in is not None and (
        not isinstance(expires_in, int | float) or isinstance(expires_in, bool) or expires_in <= 0
    ):
        raise Invalid("expires_in must be a number of seconds > 0")
    # TenancyError: invalid or not_found, answered by the dispatcher.
    user, project = tenancy.key_owner(body.get("user"), body.get("project"))
    band = tenancy.check_band(body.get("band"), h.cfg.router.bands if h.cfg else None)
    now = time.time()
    row, secret = apikeys.create(name.strip(), models, expires_in, now, user, project, band)
    h.audit(row.id, name=row.name, models=models or None, expires_in=expires_in,
            user=user, project=project, band=band or None)  # fmt: skip
    return 201, {**apikeys.key_json(row, now), "secret": secret}


def keys_revoke(h):
    ids = h.body.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise Invalid("ids must be a non-empty list of key ids")
    missing = apikeys.revoke(ids, time.time())
    if missing:
        raise NotFound(
            f"no such key: {', '.join(missing)} (see `llmgw keys list`)", "key_not_found"
        )
    for key_id in ids:
        h.audit(key_id)
    now = time.time()
    rows = ApiKey.select().where(ApiKey.id.in_(ids))
    return 200, [apikeys.key_json(r, now) for r in rows]


def peers_add(h):
    body = h.body
    name, kind = body.get("name"), body.get("kind")
    if not isinstance(name, str) or not isinstance(kind, str):
        raise Invalid("name and kind must be strings")
    keys_dir = Path(h.cfg.curve_dir())
    try:
        peer = peers.register(keys_dir, name, kind)
    except peers.PeerError as e:
        refusal = Conflict if "registered" in str(e) else Invalid
        raise refusal(str(e), "invalid_peer") from None
    out = peers.peer_json(peer)
    out["key_dir"] = str(keys_dir)
    if body.get("files") is True:
        out["files"] = peers.key_files(keys_dir, name)
    h.audit(name, action=f"{_noun(kind)}.add", files=body.get("files"))
    return 201, out
