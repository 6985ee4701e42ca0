"""Sign-on with OpenID Connect: the provider's published configuration and keys, the
checks an ID token must pass, and the claim that gives a person a role.

The admin API takes the provider's ID token as a bearer token, as Kubernetes' API
server does, rather than an access token: an ID token is a JWT for every provider, its
audience is llmgw's own client, and it is checked here with the provider's published
keys alone, with no call to the provider per request and no resource server to set up
there. (An access token's format and audience are the provider's choice: opaque for some,
a JWT for another API for others; checking those needs introspection, a call per
request.) The price is the ID token's short life: `llmgw login` asks again when it ends.

Shared by the scheduler, which checks tokens and signs browsers in, and `llmgw login`,
which reads the provider's endpoints. `check_claims` and `role_for` are pure; `Provider`
is the HTTP edge, its keys cached and fetched again when a token names a key it lacks.
"""

import base64
import json
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import requests
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from llmgw.errors import Error
from llmgw.human import age
from llmgw.operators import ADMIN, READ, Who

# Signatures with the provider's published public keys only: never "none", and never
# HS256 and kin, whose key would be the client secret every scheduler holds.
ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)
LEEWAY_S = 60.0  # clocks of the provider and this host may differ by this much
TIMEOUT_S = 5.0
# A token naming a key that is not cached makes the keys be fetched again, at most this
# often: a provider rotates its keys now and then, and a stream of tokens with made-up
# key ids must not become a stream of requests to it.
KEYS_REFRESH_MIN_S = 10.0
VIA = "oidc"  # Who.via of a person signed on through the provider


class SignOnError(Error):
    """Sign-on cannot say who a token belongs to."""


class ProviderUnavailable(SignOnError):
    """The provider's configuration or keys cannot be fetched, or make no sense."""


class IdTokenRefused(SignOnError):
    """Not a valid ID token from the configured provider for one of llmgw's clients."""


class NoRole(SignOnError):
    """A person the provider vouches for, whose claims give them no llmgw role."""


def looks_like_jwt(token: str) -> bool:
    """A compact JWS (header.payload.signature, the header JSON): not an llmgw token."""
    return token.startswith("eyJ") and token.count(".") == 2


def unverified_claims(token: str) -> dict:
    """The payload, not checked: for choosing what to check it against, for error
    messages, and for the CLI to know when its own token ends. Never for trusting."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        raise IdTokenRefused("the token is not a JWT") from None
    if not isinstance(claims, dict):
        raise IdTokenRefused("the token's payload is not a JSON object")
    return claims


def audiences_of(claims: dict) -> list[str]:
    aud = claims.get("aud")
    return [aud] if isinstance(aud, str) else [a for a in aud or [] if isinstance(a, str)]


def check_claims(
    claims: dict,
    issuer: str,
    audiences: list[str],
    now: float,
    nonce: str | None = None,
    leeway: float = LEEWAY_S,
) -> None:
    """IdTokenRefused, saying why, unless the claims are of an ID token `issuer` made for
    one of `audiences`, valid at `now` (give or take `leeway`), with `nonce` if given."""
    if claims.get("iss") != issuer:
        raise wrong_issuer(claims, issuer)
    auds = audiences_of(claims)
    if not set(auds) & set(audiences):
        raise IdTokenRefused(
            f"issued for {', '.join(auds) or 'no audience'}, not for {' or '.join(audiences)}"
        )
    # OpenID Connect Core 3.1.3.7: with several audiences, the party it was issued to.
    if len(auds) > 1 and claims.get("azp") not in audiences:
        raise IdTokenRefused(f"issued to {claims.get('azp')!r}, not to {' or '.join(audiences)}")
    exp, nbf, iat = claims.get("exp"), claims.get("nbf"), claims.get("iat")
    if not _number(exp):
        raise IdTokenRefused("the token has no expiry (exp)")
    if now > exp + leeway:
        raise IdTokenRefused(f"the token expired {age(exp, now)} ago: sign in again")
    for name, value in (("nbf", nbf), ("iat", iat)):
        if value is not None and not _number(value):
            raise IdTokenRefused(f"the token's {name} is not a number")
    if nbf is not None and now < nbf - leeway:
        raise IdTokenRefused(f"the token is not valid for another {age(now, nbf)} (nbf)")
    if iat is not None and now < iat - leeway:
        raise IdTokenRefused("the token was issued in the future (iat): check the clocks")
    if not isinstance(claims.get("sub"), str) or not claims["sub"]:
        raise IdTokenRefused("the token names no subject (sub)")
    if nonce is not None and claims.get("nonce") != nonce:
        raise IdTokenRefused("the token's nonce is not this sign-in's")


def wrong_issuer(claims: dict, issuer: str) -> IdTokenRefused:
    return IdTokenRefused(f"issued by {claims.get('iss')!r}; this scheduler signs on with {issuer}")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def claim(claims: dict, path: str):
    """The value at a dotted path ("realm_access.roles"), or None."""
    value = claims
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def role_for(claims: dict, role_claim: str, admin_values, read_values) -> str | None:
    """admin, read or None, from the role claim: a string or a list of strings."""
    value = claim(claims, role_claim)
    held = {value} if isinstance(value, str) else {v for v in value or () if isinstance(v, str)}
    if held & set(admin_values):
        return ADMIN
    if held & set(read_values):
        return READ
    return None


def person_name(claims: dict) -> str:
    """Who the audit log and the page name: the email, else the user name, else the
    subject (stable, but an opaque string at many providers)."""
    for name in ("email", "preferred_username", "sub"):
        value = claims.get(name)
        if isinstance(value, str) and value:
            return value[:200]
    return "unknown"


def who(claims: dict, role_claim: str, admin_values, read_values) -> Who:
    """The operator checked claims make; NoRole, saying what to ask for, if none."""
    name = person_name(claims)
    role = role_for(claims, role_claim, admin_values, read_values)
    if role is None:
        wanted = ", ".join([*admin_values, *read_values]) or "(none configured)"
        raise NoRole(
            f"{name} is signed in, but the '{role_claim}' claim of their ID token holds none"
            f" of {wanted}: ask whoever runs the identity provider to add them to one"
        )
    return Who(name, role, via=VIA, subject=claims["sub"])


def loopback(url: str) -> bool:
    return urlsplit(url).hostname in ("127.0.0.1", "::1", "localhost")


def _get_json(url: str) -> dict:
    try:
        r = requests.get(url, timeout=TIMEOUT_S, headers={"Accept": "application/json"})
        r.raise_for_status()
        body = r.json()
    except (requests.RequestException, ValueError) as e:
        raise ProviderUnavailable(f"cannot read {url}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(body, dict):
        raise ProviderUnavailable(f"{url} is not a JSON object")
    return body


class Provider:
    """An issuer's configuration (its discovery document) and signing keys, fetched at
    first use, not at start: a scheduler starts and its tokens work while the provider
    is down. `get(url) -> dict`: the HTTP edge (a test's fake); `clock`: monotonic."""

    def __init__(
        self,
        issuer: str,
        get: Callable[[str], dict] = _get_json,
        clock: Callable[[], float] = time.monotonic,
        refresh_min_s: float = KEYS_REFRESH_MIN_S,
    ):
        self.issuer = issuer
        self._get = get
        self._clock = clock
        self._refresh_min_s = refresh_min_s
        self._lock = threading.Lock()
        self._metadata: dict | None = None
        self._keys: KeySet | None = None
        self._kids: set[str | None] = set()
        self._fetched_at: float | None = None

    def metadata(self) -> dict:
        """The discovery document, fetched once; ProviderUnavailable if it cannot be."""
        with self._lock:
            if self._metadata is None:
                url = self.issuer.rstrip("/") + "/.well-known/openid-configuration"
                doc = self._get(url)
                if doc.get("issuer") != self.issuer:
                    raise ProviderUnavailable(
                        f"{url} names its issuer {doc.get('issuer')!r}, not {self.issuer}:"
                        " set oidc.issuer to exactly what the provider says"
                    )
                self._metadata = doc
            return self._metadata

    def endpoint(self, name: str) -> str:
        """One of the provider's endpoints (`token_endpoint`, …), or ProviderUnavailable."""
        url = self.metadata().get(name)
        if not isinstance(url, str) or not url:
            raise ProviderUnavailable(f"{self.issuer} publishes no {name}")
        return url

    def key_set(self, kid: str | None) -> KeySet:
        """The published keys, holding `kid`: fetched again when they do not, at most
        every refresh_min_s; IdTokenRefused if the provider does not publish it."""
        jwks_uri = self.endpoint("jwks_uri")
        with self._lock:
            stale = self._fetched_at is None or (
                self._clock() - self._fetched_at >= self._refresh_min_s
            )
            if (self._keys is None or kid not in self._kids) and stale:
                self._fetched_at = self._clock()
                try:
                    keys = KeySet.import_key_set(self._get(jwks_uri))
                except (JoseError, ValueError, KeyError, TypeError) as e:
                    raise ProviderUnavailable(f"{jwks_uri} holds no usable keys: {e}") from None
                self._keys = keys
                self._kids = {k.kid for k in keys.keys}
            if self._keys is None:
                raise ProviderUnavailable(f"{jwks_uri} has not been read yet")
            if kid is not None and kid not in self._kids:
                raise IdTokenRefused(
                    f"signed with key {kid!r}, which {self.issuer} does not publish"
                )
            return self._keys

    def verify(
        self, token: str, audiences: list[str], now: float | None = None, nonce: str | None = None
    ) -> dict:
        """An ID token's claims once its signature and claims pass, else IdTokenRefused
        with the reason. A token from another issuer is refused before any key is
        fetched for it."""
        claims = unverified_claims(token)
        if claims.get("iss") != self.issuer:  # the clear reason, and no fetch for it
            raise wrong_issuer(claims, self.issuer)
        try:
            header = json.loads(_unpad(token.split(".")[0]))
        except ValueError:
            raise IdTokenRefused("the token's header is not JSON") from None
        if header.get("alg") not in ALGORITHMS:
            raise IdTokenRefused(
                f"the token is signed with {header.get('alg')!r}, not one of"
                f" {', '.join(ALGORITHMS)}"
            )
        keys = self.key_set(header.get("kid"))
        try:
            claims = jwt.decode(token, keys, algorithms=list(ALGORITHMS)).claims
        except (JoseError, ValueError) as e:
            raise IdTokenRefused(f"its signature does not verify: {e}") from None
        check_claims(claims, self.issuer, audiences, time.time() if now is None else now, nonce)
        return claims


def _unpad(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
