"""API keys: how secrets are made and hashed, shared by the CLI and the router.

A secret is `sk-llmgw-` and 43 random URL-safe characters (256 bits). Because it is
random, a plain SHA-256 is a safe hash for it: nothing to brute-force, and the
router can check a key in a microsecond.
"""

import hashlib
import re
import secrets
import time

PREFIX = "sk-llmgw-"

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def new_id() -> str:
    return "key_" + secrets.token_hex(6)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_duration(text: str) -> float:
    """'30d' -> seconds. Units: s, m, h, d, w."""
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"bad duration {text!r}: want a number and a unit, like 90m, 12h or 30d")
    return int(match.group(1)) * _UNIT[match.group(2)]


def create(
    name: str,
    models: list[str],
    expires_in: float | None,
    now: float | None = None,
    user: str | None = None,
    project: str | None = None,
    band: str = "",
):
    """Create a key in the store; return (row, secret). The secret is never stored.
    `user` and `project` must have been checked (llmgw.tenancy.key_owner)."""
    from llmgw.store import ApiKey

    now = time.time() if now is None else now
    secret = new_secret()
    row = ApiKey.create(
        id=new_id(),
        name=name,
        secret_hash=hash_secret(secret),
        prefix=secret[: len(PREFIX) + 4],
        models=",".join(models),
        created_at=now,
        expires_at=now + expires_in if expires_in else None,
        updated_at=now,
        user=user,
        project=project,
        band=band or "",
    )
    return row, secret


def engine_key(cluster_secret: str, replica_id: str) -> str:
    """The key one engine demands: only the scheduler and routers can compute it."""
    import hmac

    return hmac.new(cluster_secret.encode(), replica_id.encode(), hashlib.sha256).hexdigest()


def state_of(row, now: float) -> str:
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= now:
        return "expired"
    return "active"


def key_json(row, now: float) -> dict:
    """The one JSON shape of a key, used by the admin API and every command that prints keys."""
    return {
        "id": row.id,
        "name": row.name,
        "prefix": row.prefix,
        "models": row.model_list,
        "created_at": row.created_at,
        "expires_at": row.expires_at,
        "revoked_at": row.revoked_at,
        "state": state_of(row, now),
        "user": row.user,
        "project": row.project,
        "band": row.band or None,
    }


def listing(show_all: bool, now: float) -> list[dict]:
    """Keys, oldest first: the active ones, or all with `show_all`."""
    from llmgw.store import ApiKey

    rows = ApiKey.select().order_by(ApiKey.created_at)
    return [key_json(r, now) for r in rows if show_all or state_of(r, now) == "active"]


def revoke(ids: list[str], now: float) -> list[str]:
    """Revoke keys by id, all or none; return the ids not found (nothing revoked then)."""
    from llmgw.store import ApiKey

    missing = [k for k in ids if ApiKey.get_or_none(ApiKey.id == k) is None]
    if missing:
        return missing
    ApiKey.update(revoked_at=now, updated_at=now).where(
        ApiKey.id.in_(ids) & ApiKey.revoked_at.is_null()
    ).execute()
    return []
