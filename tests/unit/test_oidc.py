"""Sign-on's pure parts: an ID token's claims at a given time, the role a claim gives,
the name the audit log keeps, the provider's keys cached and fetched again, and the
settings a scheduler refuses to start with. The real provider is tests/system/test_signon.py's."""

import base64
import json

import pytest
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from llmgw import oidc
from llmgw.config import OidcConfig
from llmgw.errors import ConfigError
from llmgw_scheduler import signon

ISSUER = "https://id.example.org/realms/ops"
NOW = 1_800_000_000.0


def b64(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def claims(**over) -> dict:
    base = {"iss": ISSUER, "aud": "llmgw", "sub": "u-1", "exp": NOW + 300, "iat": NOW - 10}
    return {k: v for k, v in {**base, **over}.items() if v is not None}


def refused(c: dict, now: float = NOW, **kw) -> str:
    with pytest.raises(oidc.IdTokenRefused) as e:
        oidc.check_claims(c, ISSUER, ["llmgw", "llmgw-cli"], now, **kw)
    return str(e.value)


def test_claims_from_the_issuer_for_one_of_our_clients_in_their_lifetime_pass():
    oidc.check_claims(claims(), ISSUER, ["llmgw", "llmgw-cli"], NOW)
    oidc.check_claims(claims(aud="llmgw-cli"), ISSUER, ["llmgw", "llmgw-cli"], NOW)
    oidc.check_claims(claims(aud=["llmgw", "x"], azp="llmgw"), ISSUER, ["llmgw"], NOW)


def test_each_wrong_claim_is_refused_saying_which():
    assert "issued by 'https://evil.example'" in refused(claims(iss="https://evil.example"))
    assert "issued for grafana, not for llmgw or llmgw-cli" in refused(claims(aud="grafana"))
    assert "no audience" in refused(claims(aud=None))
    assert "issued to 'x'" in refused(claims(aud=["llmgw", "x"], azp="x"))
    assert "no expiry" in refused(claims(exp=None))
    assert "no expiry" in refused(claims(exp="tomorrow"))
    assert "names no subject" in refused(claims(sub=""))
    assert "nonce is not this sign-in's" in refused(claims(nonce="a"), nonce="b")


def test_expiry_and_not_before_allow_a_minute_of_clock_skew_and_no_more():
    c = claims(exp=NOW, nbf=NOW)
    oidc.check_claims(c, ISSUER, ["llmgw"], NOW + oidc.LEEWAY_S)
    oidc.check_claims(c, ISSUER, ["llmgw"], NOW - oidc.LEEWAY_S)
    assert "expired 1m ago" in refused(c, now=NOW + oidc.LEEWAY_S + 1)
    assert "not valid for another 1m" in refused(c, now=NOW - oidc.LEEWAY_S - 1)
    assert "issued in the future" in refused(claims(iat=NOW + 3600))


def test_the_role_claim_gives_admin_before_read_and_nothing_else_gives_a_role():
    role = lambda c: oidc.role_for(c, "groups", ["ops"], ["dev", "qa"])  # noqa: E731
    assert role({"groups": ["dev", "ops"]}) == "admin"
    assert role({"groups": ["qa"]}) == "read"
    assert role({"groups": "dev"}) == "read", "a single string counts"
    assert role({"groups": ["sales"]}) is None
    assert role({"groups": [{"name": "ops"}]}) is None, "only strings count"
    assert role({}) is None
    keycloak = {"realm_access": {"roles": ["ops", "offline_access"]}}
    assert oidc.role_for(keycloak, "realm_access.roles", ["ops"], []) == "admin"
    assert oidc.role_for({"realm_access": "ops"}, "realm_access.roles", ["ops"], []) is None


def test_a_person_is_named_by_email_else_user_name_else_subject():
    assert oidc.person_name({"sub": "1", "preferred_username": "ada", "email": "a@x"}) == "a@x"
    assert oidc.person_name({"sub": "1", "preferred_username": "ada"}) == "ada"
    assert oidc.person_name({"sub": "1", "email": ""}) == "1"
    who = oidc.who({"sub": "1", "email": "a@x", "groups": ["ops"]}, "groups", ["ops"], [])
    assert (who.name, who.role, who.via, who.subject) == ("a@x", "admin", "oidc", "1")
    with pytest.raises(oidc.NoRole, match="a@x is signed in, but the 'groups' claim"):
        oidc.who({"sub": "1", "email": "a@x"}, "groups", ["ops"], ["dev"])


# -- the provider's keys --------------------------------------------------------------------


class FakeProvider:
    """The provider's two documents, and every URL asked for."""

    def __init__(self):
        self.keys = [RSAKey.generate_key(2048, parameters={"kid": "k1"})]
        self.asked: list[str] = []

    def get(self, url: str) -> dict:
        self.asked.append(url)
        if url.endswith("/.well-known/openid-configuration"):
            return {"issuer": ISSUER, "jwks_uri": f"{ISSUER}/jwks"}
        return KeySet(self.keys).as_dict(private=False)

    def sign(self, kid: str, **over) -> str:
        [key] = [k for k in self.keys if k.kid == kid] or [RSAKey.generate_key(2048)]
        return jwt.encode({"alg": "RS256", "kid": kid}, claims(**over), key)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_keys_are_fetched_once_and_again_only_for_a_key_they_lack_at_most_every_10s():
    fake, clock = FakeProvider(), Clock()
    p = oidc.Provider(ISSUER, get=fake.get, clock=clock)
    assert p.verify(fake.sign("k1"), ["llmgw"], now=NOW)["sub"] == "u-1"
    assert p.verify(fake.sign("k1"), ["llmgw"], now=NOW)["sub"] == "u-1"
    assert fake.asked.count(f"{ISSUER}/jwks") == 1, "cached"

    fake.keys.append(RSAKey.generate_key(2048, parameters={"kid": "k2"}))  # rotated
    clock.t = 5.0
    with pytest.raises(oidc.IdTokenRefused, match="key 'k2', which .* does not publish"):
        p.verify(fake.sign("k2"), ["llmgw"], now=NOW)
    assert fake.asked.count(f"{ISSUER}/jwks") == 1, "not again within 10 s"
    clock.t = 10.0
    assert p.verify(fake.sign("k2"), ["llmgw"], now=NOW)["sub"] == "u-1"
    assert fake.asked.count(f"{ISSUER}/jwks") == 2

    clock.t = 11.0
    for _ in range(5):  # made-up key ids: at most one fetch per 10 s between them
        with pytest.raises(oidc.IdTokenRefused):
            p.verify(fake.sign("made-up"), ["llmgw"], now=NOW)
    assert fake.asked.count(f"{ISSUER}/jwks") == 2
    assert fake.asked.count(f"{ISSUER}/.well-known/openid-configuration") == 1


def test_a_token_from_another_issuer_or_unsigned_is_refused_before_any_fetch():
    fake = FakeProvider()
    p = oidc.Provider(ISSUER, get=fake.get)
    with pytest.raises(oidc.IdTokenRefused, match="issued by 'https://other'"):
        p.verify(fake.sign("k1", iss="https://other"), ["llmgw"], now=NOW)
    unsigned = f"{b64({'alg': 'none'})}.{b64(claims())}."
    with pytest.raises(oidc.IdTokenRefused, match="signed with 'none'"):
        p.verify(unsigned, ["llmgw"], now=NOW)
    assert fake.asked == []


def test_a_discovery_document_for_another_issuer_is_not_trusted():
    p = oidc.Provider(ISSUER, get=lambda url: {"issuer": ISSUER + "/", "jwks_uri": "x"})
    with pytest.raises(oidc.ProviderUnavailable, match="names its issuer"):
        p.metadata()


def test_an_unreachable_provider_is_said_so_and_asked_again_at_the_next_token():
    answers = [oidc.ProviderUnavailable("cannot read it"), {"issuer": ISSUER, "jwks_uri": "k"}]

    def get(url):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    p = oidc.Provider(ISSUER, get=get)
    with pytest.raises(oidc.ProviderUnavailable, match="cannot read it"):
        p.metadata()
    assert p.metadata()["jwks_uri"] == "k"


def test_a_provider_that_does_not_answer_is_named_with_the_reason():
    p = oidc.Provider("http://127.0.0.1:9")  # discard: nothing listens
    with pytest.raises(oidc.ProviderUnavailable, match="cannot read http://127.0.0.1:9/"):
        p.metadata()


# -- the scheduler's settings -----------------------------------------------------------------


def good(**over) -> OidcConfig:
    base = {"issuer": ISSUER, "client_id": "llmgw", "redirect_url": "https://s/oidc/callback"}
    return OidcConfig(**{**base, **over})


@pytest.mark.parametrize(
    "over, message",
    [
        ({"issuer": "http://id.example.org"}, "must be an https:// URL"),
        ({"client_id": ""}, "oidc.client_id is needed"),
        ({"redirect_url": ""}, "oidc.redirect_url is needed"),
        ({"admin_values": [], "read_values": []}, "both empty"),
        ({"scopes": ["email"]}, "must hold 'openid'"),
        ({"session_s": 0.0}, "session_s must be more than 0"),
    ],
)
def test_the_scheduler_will_not_start_with_sign_on_it_cannot_do(over, message):
    with pytest.raises(ConfigError, match=message):
        signon.check(good(**over))


def test_sign_on_may_use_plain_http_on_loopback_only_and_is_off_without_an_issuer():
    signon.check(good(issuer="http://127.0.0.1:5556/dex"))
    signon.check(OidcConfig())


def test_sign_ins_under_way_are_bounded_and_forgotten_after_ten_minutes():
    class Meta:
        def endpoint(self, name):
            return "https://id.example.org/auth"

    clock = Clock()
    s = signon.SignOn(good(), provider=Meta(), clock=clock)
    first, url = s.begin("/status")
    assert url.startswith("https://id.example.org/auth?") and "code_challenge=" in url
    for _ in range(signon.MAX_PENDING + 5):
        s.begin("/status")
    assert len(s._pending) == signon.MAX_PENDING
    assert first not in s._pending, "the oldest went first"
    clock.t = signon.LOGIN_S + 1
    s.begin("/")
    assert len(s._pending) == 1
