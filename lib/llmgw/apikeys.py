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


def create(name: str, models: list[str], expires_in: float | None, now: float | None = None):
    """Create a key in the store; return (row, secret). The secret is never stored."""
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
    )
    return row, secret


def engine_key(cluster_secret: str, replica_id: str) -> str:
    """The key one engine demands: only the scheduler and routers can compute it."""
    import hmac

    return hmac.new(cluster_secret.encode(), replica_id.encode(), hashlib.sha256).hexdigest()
