"""The admin API's join tokens (lib/llmgw/jointokens.py).

For operators:
  POST /v1/nodes/NAME/join-token   {"ttl_s": 3600}: a one-time token for NAME
For a node joining (no operator token; the join token is the credential):
  GET  /v1/join/ca                 the cluster CA's certificate, which the node checks
                                   against the fingerprint it was given before trusting
  POST /v1/join                    {"token", "public_key"}: register the node's own
                                   CURVE public key; answers its name, the scheduler's
                                   public key and the bus port

Join tokens need the admin API on HTTPS with a certificate from the cluster CA: the
token and the scheduler's key must not cross the network in the clear.
"""

import time
from pathlib import Path

from llmgw import audit, bus, jointokens, log
from llmgw.errors import Conflict
from llmgw.store import BusPeer

_log = log.get("llmgw.scheduler.admin")

JOIN_TOKEN = "join-token"  # the audit log's actor for a node that joined with one


def _audit(action: str, target: str, client: str, **detail) -> None:
    """As the admin API's changes are, with the join token as the actor."""
    _log.info("admin_change", action=action, target=target or None, actor=JOIN_TOKEN,
              client=client, **detail)  # fmt: skip
    try:
        audit.record(action, JOIN_TOKEN, client, target, **detail)
    except Exception as e:  # the store is down: the journal keeps it
        _log.error("audit_write_failed", action=action, target=target, reason=str(e)[:200])


def _ca_pem(h) -> str:
    cfg = h.cfg
    ca = cfg.ca_file()
    if not cfg.scheduler.admin_tls_cert or not ca.exists():
        raise Conflict(
            "join tokens need the admin API on HTTPS with a certificate from the cluster CA"
            f" ({ca}): `llmgw-certmon init-ca`, `llmgw-certmon issue HOST --san ...`, then"
            " scheduler.admin_tls_cert and admin_tls_key",
            code="join_needs_tls",
        )
    return ca.read_text()


def public_get(h, parts: list[str]) -> bool:
    if parts != ["v1", "join", "ca"]:
        return False
    h._send(200, {"ca": _ca_pem(h)})
    return True


def public_post(h, parts: list[str]) -> bool:
    """POST /v1/join: authenticated by the join token in the body, not an operator's."""
    if parts != ["v1", "join"]:
        return False
    _ca_pem(h)  # never over plain HTTP
    body = h._body()
    if body is None:
        return True
    public = jointokens.check_public_key(body.get("public_key"))
    client = h.client_address[0]
    try:
        row = jointokens.redeem(str(body.get("token") or ""), time.time(), client)
    except jointokens.TokenRefused as e:
        _audit("nodes.join_refused", "", client, reason=e.code)
        raise
    name = row.node
    jointokens.refuse_taken(name, BusPeer.get_or_none(BusPeer.name == name) is not None)
    BusPeer.create(name=name, kind="agent", public_key=public, created_at=time.time())
    _audit("nodes.join", name, client, public_key=public[:8])
    curve = Path(h.cfg.curve_dir())
    bus.create_keypair(curve, bus.SCHEDULER)
    h._send(201, {
        "name": name,
        "scheduler_key": (curve / f"{bus.SCHEDULER}.key").read_text(),
        "bus_port": int(h.cfg.scheduler.bus.rpartition(":")[2]),
        "ca": _ca_pem(h),
    })  # fmt: skip
    return True


def post(h, parts: list[str]) -> bool:
    """POST /v1/nodes/NAME/join-token (an operator's)."""
    if len(parts) != 4 or parts[:2] != ["v1", "nodes"] or parts[3] != "join-token":
        return False
    body = h._body()
    if body is None:
        return True
    name = parts[2]
    ca = _ca_pem(h)
    ttl = body.get("ttl_s", 3600)
    if not isinstance(ttl, int | float) or isinstance(ttl, bool):
        ttl = -1
    jointokens.refuse_taken(name, BusPeer.get_or_none(BusPeer.name == name) is not None)
    row, token = jointokens.create(name, float(ttl), time.time())
    fp = jointokens.fingerprint(ca)
    url = h.sched.commands.mirror_url  # this scheduler's admin URL, as nodes reach it
    h._change("nodes.join_token", name, expires_at=row.expires_at, ttl_s=ttl)
    h._send(201, {
        "node": name, "token": token, "expires_at": row.expires_at, "url": url,
        "ca_sha256": fp,
        "command": f"llmgw-agentd join {url} {token} --ca-sha256 {fp}",
    })  # fmt: skip
    return True
