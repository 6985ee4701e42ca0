"""Operators: one admin API token per person or script, each with a role (or a person
signed on through the identity provider, oidc.py).

`read` may look (status, lists, logs, the audit log, the page); `admin` may also
change things. The shared bootstrap token (`secrets/admin.token`) stays, as `admin`:
it is how the first operator is made. Only the SHA-256 of a token is stored, and the
audit log names the operator a token belongs to, not the label a client sends.
"""

import hmac
import re
import secrets
import time
from dataclasses import dataclass

import peewee

from llmgw.apikeys import hash_secret
from llmgw.errors import Conflict, Invalid, NotFound
from llmgw.store import Operator

READ, ADMIN = "read", "admin"
ROLES = (READ, ADMIN)
BOOTSTRAP = "admin"  # the name the bootstrap token acts under in the audit log
TOKEN_PREFIX = "llmgw-op-"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$")


@dataclass(frozen=True, slots=True)
class Who:
    """Who a request's token says it is."""

    name: str
    role: str
    bootstrap: bool = False
    via: str = "token"  # or "oidc": signed on through the identity provider (oidc.py)
    subject: str = ""  # oidc: the provider's `sub` for the person, stable where names change

    def may_change(self) -> bool:
        return self.role == ADMIN


def identify(token: str, bootstrap_token: str) -> Who | None:
    """The operator behind `token`, or None. One hash and one indexed lookup."""
    if not token:
        return None
    # Bytes: compare_digest refuses str with non-ASCII characters, which a URL can carry.
    if bootstrap_token and hmac.compare_digest(token.encode(), bootstrap_token.encode()):
        return Who(BOOTSTRAP, ADMIN, bootstrap=True)
    if not token.startswith(TOKEN_PREFIX):
        return None
    row = Operator.get_or_none(Operator.token_hash == hash_secret(token))
    return None if row is None else Who(row.name, row.role)


def create(name: str, role: str, now: float | None = None) -> tuple[dict, str]:
    """Make an operator; return its JSON and its token (shown once)."""
    if not _NAME.match(name or ""):
        raise Invalid(
            f"operator name {name!r}: use letters, digits and . _ @ + - (at most 100)",
            "invalid_operator",
        )
    if name == BOOTSTRAP:
        raise Invalid(
            f"'{BOOTSTRAP}' is the bootstrap token's name: choose another", "invalid_operator"
        )
    if role not in ROLES:
        raise Invalid(f"role {role!r}: choose one of {', '.join(ROLES)}", "invalid_operator")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    try:
        row = Operator.create(
            name=name,
            role=role,
            token_hash=hash_secret(token),
            created_at=time.time() if now is None else now,
        )
    except peewee.IntegrityError:
        raise Conflict(f"operator '{name}' exists already", "invalid_operator") from None
    return operator_json(row), token


def remove(name: str) -> None:
    """Forget an operator: its token stops working at once."""
    if Operator.delete().where(Operator.name == name).execute() == 0:
        raise NotFound(f"no operator '{name}' (see `llmgw operators list`)", "operator_not_found")


def listing() -> list[dict]:
    return [operator_json(r) for r in Operator.select().order_by(Operator.name)]


def operator_json(row: Operator) -> dict:
    """The one JSON shape of an operator (never the token)."""
    return {"name": row.name, "role": row.role, "created_at": row.created_at}
