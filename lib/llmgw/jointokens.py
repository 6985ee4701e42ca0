"""Join tokens: how a new node joins the fleet without anyone copying keys by hand.

`llmgw nodes join-token NAME` makes a token for NAME that works once and expires;
`llmgw-agentd join URL TOKEN --ca-sha256 FP` first checks that the control plane's CA
is the one whose fingerprint the operator was given (so the token is never shown to
anyone else), then redeems the token over HTTPS verified by that CA, sending the CURVE
public key it made for itself: its secret key never leaves the node. Only the token's
SHA-256 is stored; making and redeeming one are in the audit log.
"""

import hashlib
import re
import secrets
import ssl

from llmgw.errors import Conflict, Invalid, Refused
from llmgw.store import JoinToken

PREFIX = "llmgw-join-"
MAX_TTL_S = 7 * 86400
_FINGERPRINT = re.compile(r"^[0-9a-f]{64}$")


class TokenRefused(Refused):
    """A join token that is unknown, used already or expired."""

    code = "join_refused"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(node: str, ttl_s: float, now: float) -> tuple[JoinToken, str]:
    """A new token for `node`, valid `ttl_s` from `now`; (row, token). The token is shown
    once and never stored."""
    if not 0 < ttl_s <= MAX_TTL_S:
        raise Invalid(f"ttl must be more than 0 and at most {MAX_TTL_S // 86400} days")
    token = PREFIX + secrets.token_urlsafe(32)
    row = JoinToken.create(token_hash=hash_token(token), node=node, created_at=now,
                           expires_at=now + ttl_s)  # fmt: skip
    return row, token


def redeem(token: str, now: float, client: str) -> JoinToken:
    """Use `token` once: its row, marked used; TokenRefused with the reason if it is
    unknown, used or expired. One UPDATE decides, so two nodes racing with one token
    cannot both join."""
    h = hash_token(token or "")
    taken = (
        JoinToken.update(used_at=now, used_from=client[:100])
        .where(
            (JoinToken.token_hash == h) & JoinToken.used_at.is_null() & (JoinToken.expires_at > now)
        )  # fmt: skip
        .execute()
    )
    row = JoinToken.get_or_none(JoinToken.token_hash == h)
    if taken == 1:
        return row
    if row is None:
        raise TokenRefused("not a join token: ask the operator for one (`llmgw nodes join-token`)")
    if row.used_at is not None:
        raise TokenRefused(
            f"this join token for {row.node} was used already (from {row.used_from}):"
            " a token works once; ask for a new one",
            code="join_token_used",
        )
    raise TokenRefused(
        f"this join token for {row.node} has expired: ask for a new one", code="join_token_expired"
    )


def fingerprint(pem: str) -> str:
    """The SHA-256 of a PEM certificate's DER bytes, hex: what --ca-sha256 names."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def normal_fingerprint(text: str) -> str:
    """AB:CD:… or abcd… -> abcd…; Invalid if it is not a SHA-256."""
    fp = text.replace(":", "").strip().lower()
    if not _FINGERPRINT.match(fp):
        raise Invalid(f"--ca-sha256 {text!r}: want the 64 hex digits `join-token` printed")
    return fp


def check_public_key(public: str) -> str:
    """A CURVE public key as zmq writes it: 40 Z85 characters."""
    if not isinstance(public, str) or len(public) != 40:
        raise Invalid("public_key must be a CURVE public key (40 Z85 characters)")
    return public


def refuse_taken(node: str, registered: bool) -> None:
    if registered:
        raise Conflict(
            f"node {node} is registered already: `llmgw nodes remove {node}` first, or pick"
            " another name",
            code="node_exists",
        )
