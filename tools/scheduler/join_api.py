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

from llmgw import bus, jointokens
from llmgw.errors import Conflict
from llmgw.operators import Who
from llmgw.store import BusPeer

JOIN_TOKEN = "join-token"  # the audit log's actor for a node that joined with one


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


def ca(h):
    return 200, {"ca": _ca_pem(h)}


def authenticate(h) -> Who:
    """The join token in the body, redeemed once: HTTPS only (the token must not cross
    the network in the clear), and the public key checked first so that a bad one does
    not use the token up. A refusal is audited and answered 403 with its reason."""
    _ca_pem(h)
    body = h.json_body()
    h.public_key = jointokens.check_public_key(body.get("public_key"))
    try:
        h.joined = jointokens.redeem(str(body.get("token") or ""), time.time(), h.client_address[0])
    except jointokens.TokenRefused as e:
        h.audit("", action="nodes.join_refused", reason=e.code)
        raise
    return Who(JOIN_TOKEN, "node")


def join(h):
    """POST /v1/join, once `authenticate` has redeemed the token: register the node's
    own public key; answer its name, the scheduler's public key and the bus port."""
    name, public = h.joined.node, h.public_key
    jointokens.refuse_taken(name, BusPeer.get_or_none(BusPeer.name == name) is not None)
    BusPeer.create(name=name, kind="agent", public_key=public, created_at=time.time())
    h.audit(name, public_key=public[:8])
    curve = Path(h.cfg.curve_dir())
    bus.create_keypair(curve, bus.SCHEDULER)
    return 201, {
        "name": name,
        "scheduler_key": (curve / f"{bus.SCHEDULER}.key").read_text(),
        "bus_port": int(h.cfg.scheduler.bus.rpartition(":")[2]),
        "ca": _ca_pem(h),
    }


def join_token(h, name: str):
    """POST /v1/nodes/NAME/join-token (an operator's)."""
    ca = _ca_pem(h)
    ttl = h.body.get("ttl_s", 3600)
    if not isinstance(ttl, int | float) or isinstance(ttl, bool):
        ttl = -1
    jointokens.refuse_taken(name, BusPeer.get_or_none(BusPeer.name == name) is not None)
    row, token = jointokens.create(name, float(ttl), time.time())
    fp = jointokens.fingerprint(ca)
    url = h.sched.commands.mirror_url  # this scheduler's admin URL, as nodes reach it
    h.audit(name, expires_at=row.expires_at, ttl_s=ttl)
    return 201, {
        "node": name, "token": token, "expires_at": row.expires_at, "url": url,
        "ca_sha256": fp,
        "command": f"llmgw-agentd join {url} {token} --ca-sha256 {fp}",
    }  # fmt: skip
