"""Sign-on through the identity provider (OpenID Connect), for the status page and the
admin API; off unless [oidc] issuer is set.

GET  /login            a browser on its way to the provider: the code flow with PKCE
GET  /oidc/callback    back from it: the code is traded for an ID token, checked, and
                       a session cookie set
POST /logout           the session ends
GET  /v1/signon        the issuer and the public client `llmgw login` uses (public)

The admin API takes an ID token as a bearer token (`identify`); the page takes the
session cookie too. Sessions live in this scheduler's memory: a restart or another
scheduler means signing in again, which the provider's own session makes one click.
A session is not a bearer credential for the JSON API, whose changes must not be
something another site can make a signed-in browser send.
"""

import secrets
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from html import escape
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl

import requests
from authlib.integrations.base_client import OAuthError
from authlib.integrations.requests_client import OAuth2Session

from llmgw import log, oidc
from llmgw.errors import ConfigError, NotFound
from llmgw.operators import Who

_log = log.get("llmgw.scheduler.signon")

SESSION_COOKIE = "llmgw_session"
LOGIN_COOKIE = "llmgw_login"  # binds a sign-in to the browser that began it
LOGIN_S = 600.0  # a sign-in not finished within this is forgotten
MAX_PENDING = 1000  # /login is open to anyone: what it may hold is bounded
NEXT = ("/", "/status")  # where a sign-in may return to: the page, never elsewhere


@dataclass(frozen=True, slots=True)
class Pending:
    """A sign-in under way: what the callback must match."""

    verifier: str  # PKCE's code verifier
    nonce: str
    next: str
    began: float


@dataclass(frozen=True, slots=True)
class Session:
    who: Who
    expires: float


def check(cfg) -> None:
    """ConfigError for [oidc] settings the scheduler cannot sign on with (at start)."""
    if not cfg.issuer:
        return
    if not cfg.issuer.startswith("https://") and not (
        cfg.issuer.startswith("http://") and oidc.loopback(cfg.issuer)
    ):
        raise ConfigError(f"oidc.issuer {cfg.issuer!r} must be an https:// URL")
    for key in ("client_id", "redirect_url"):
        if not getattr(cfg, key):
            raise ConfigError(f"oidc.{key} is needed when oidc.issuer is set")
    if not (cfg.admin_values or cfg.read_values):
        raise ConfigError("oidc.admin_values and oidc.read_values are both empty: nobody")
    if "openid" not in cfg.scopes:
        raise ConfigError("oidc.scopes must hold 'openid'")
    if cfg.session_s <= 0:
        raise ConfigError("oidc.session_s must be more than 0")


class SignOn:
    """One scheduler's sign-on: the provider, the sign-ins under way and the sessions.
    The admin API's handler threads share it; `clock` is wall time (tokens carry it)."""

    def __init__(self, cfg, provider: oidc.Provider | None = None, clock=time.time):
        check(cfg)
        self.cfg = cfg
        self.provider = provider or oidc.Provider(cfg.issuer)
        self.clock = clock
        self.cli_client_id = cfg.cli_client_id or cfg.client_id
        self.audiences = list(dict.fromkeys([cfg.client_id, self.cli_client_id]))
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self._sessions: dict[str, Session] = {}

    def identify(self, token: str) -> Who:
        """The person an ID token names, with their role: IdTokenRefused, NoRole or
        ProviderUnavailable (oidc.py) if not."""
        claims = self.provider.verify(token, self.audiences, now=self.clock())
        return self._who(claims)

    def _who(self, claims: dict) -> Who:
        c = self.cfg
        return oidc.who(claims, c.role_claim, c.admin_values, c.read_values)

    # -- the browser's sign-in ----------------------------------------------------------

    def _client(self) -> OAuth2Session:
        c = self.cfg
        return OAuth2Session(
            c.client_id,
            c.client_secret or None,
            token_endpoint_auth_method="client_secret_basic" if c.client_secret else "none",
            scope=" ".join(c.scopes),
            redirect_uri=c.redirect_url,
            code_challenge_method="S256",
        )

    def begin(self, next_path: str) -> tuple[str, str]:
        """(state, the provider's authorization URL) for a new sign-in."""
        url = self.provider.endpoint("authorization_endpoint")
        state, verifier, nonce = (secrets.token_urlsafe(32) for _ in range(3))
        now = self.clock()
        with self._lock:
            for key, p in list(self._pending.items()):
                if now - p.began < LOGIN_S and len(self._pending) < MAX_PENDING:
                    break
                del self._pending[key]  # the oldest first: expired, or over the bound
            self._pending[state] = Pending(verifier, nonce, next_path, now)
        with self._client() as client:
            location, _ = client.create_authorization_url(
                url, state=state, code_verifier=verifier, nonce=nonce
            )
        return state, location

    def finish(self, state: str, code: str, browser_state: str | None) -> tuple[Session, str, str]:
        """(the new session, its id, where to go) once the provider's code is traded for
        an ID token that checks out; IdTokenRefused, NoRole or ProviderUnavailable."""
        with self._lock:
            pending = self._pending.pop(state, None)
        if pending is None or browser_state != state or self.clock() - pending.began > LOGIN_S:
            raise oidc.IdTokenRefused(
                "this sign-in is not one this browser began here, or it took too long"
            )
        token_url = self.provider.endpoint("token_endpoint")
        try:
            with self._client() as client:
                token = client.fetch_token(
                    token_url, code=code, code_verifier=pending.verifier, timeout=oidc.TIMEOUT_S
                )
        except OAuthError as e:
            raise oidc.IdTokenRefused(
                f"the provider refused the code: {e.error} {e.description or ''}".strip()
            ) from None
        except requests.RequestException as e:
            raise oidc.ProviderUnavailable(f"cannot reach {token_url}: {e}") from None
        id_token = token.get("id_token")
        if not id_token:
            raise oidc.IdTokenRefused("the provider answered with no ID token: is 'openid' asked?")
        claims = self.provider.verify(
            id_token, [self.cfg.client_id], now=self.clock(), nonce=pending.nonce
        )
        session = Session(self._who(claims), self.clock() + self.cfg.session_s)
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = self.clock()
            for key in [k for k, s in self._sessions.items() if s.expires <= now]:
                del self._sessions[key]
            self._sessions[sid] = session
        return session, sid, pending.next

    def session(self, sid: str | None) -> Who | None:
        """The person a session cookie is for, while it lasts."""
        if not sid:
            return None
        with self._lock:
            s = self._sessions.get(sid)
            if s is not None and s.expires <= self.clock():
                del self._sessions[sid]
                s = None
        return None if s is None else s.who

    def end(self, sid: str | None) -> Who | None:
        with self._lock:
            s = self._sessions.pop(sid, None) if sid else None
        return None if s is None else s.who


# -- the HTTP edge (routes.py) -------------------------------------------------------------


def cookie(handler, name: str) -> str | None:
    try:
        jar = SimpleCookie(handler.headers.get("Cookie", ""))
    except CookieError:
        return None
    morsel = jar.get(name)
    return morsel.value if morsel else None


def set_cookie(handler, name: str, value: str, max_age: float) -> str:
    """HttpOnly; SameSite=Lax, as the provider's redirect back is a navigation from
    another site that must bring it; Secure over HTTPS."""
    jar = SimpleCookie()
    jar[name] = value
    jar[name].update(
        {"httponly": True, "samesite": "Lax", "path": "/", "max-age": str(max(0, int(max_age)))}
    )
    if isinstance(handler.connection, ssl.SSLSocket):
        jar[name]["secure"] = True
    return jar[name].OutputString()


def _page(handler, status: int, title: str, text: str, headers: dict | None = None) -> None:
    from llmgw_scheduler import page  # page imports this module for the session

    body = (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>llmgw: '
        f"{escape(title)}</title><style>{page.CSS}</style></head><body><h1>llmgw</h1>"
        f"<p>{text}</p></body></html>\n"
    )
    page.send(handler, status, body, headers)


def _signon(handler) -> SignOn:
    if handler.signon is None:
        raise NotFound(
            "sign-on is not configured on this scheduler ([oidc] issuer)", "signon_not_configured"
        )
    return handler.signon


def login(h):
    """GET /login[?next=/status]: off to the provider, with a cookie that binds the
    sign-in to this browser."""
    s = _signon(h)
    wanted = h.q.get("next", "/status")
    try:
        state, location = s.begin(wanted if wanted in NEXT else "/status")
    except oidc.ProviderUnavailable as e:
        _log.warning("signon_unavailable", reason=str(e))
        return _page(h, 503, "sign-in unavailable", escape(f"Cannot sign in now: {e}"))
    headers = {"Location": location, "Set-Cookie": set_cookie(h, LOGIN_COOKIE, state, LOGIN_S)}
    return _page(h, 303, "signing in", "Signing in…", headers)


def callback(h):
    """GET /oidc/callback?code&state: the session, or a page that says why not."""
    s = _signon(h)
    query = dict(parse_qsl(h.url.query))
    clear = set_cookie(h, LOGIN_COOKIE, "", 0)
    if "error" in query:
        why = f"{query['error']} {query.get('error_description', '')}".strip()
        _log.warning("signon_refused", reason=why[:200], client=h.client_address[0])
        return _page(
            h,
            403,
            "not signed in",
            escape(f"The identity provider said: {why}. ") + '<a href="/login">Try again</a>.',
            {"Set-Cookie": clear},
        )
    try:
        session, sid, next_path = s.finish(
            query.get("state", ""), query.get("code", ""), cookie(h, LOGIN_COOKIE)
        )
    except oidc.NoRole as e:
        _log.warning("signon_no_role", reason=str(e), client=h.client_address[0])
        return _page(h, 403, "no role", escape(str(e)), {"Set-Cookie": clear})
    except oidc.ProviderUnavailable as e:
        _log.warning("signon_unavailable", reason=str(e))
        return _page(
            h, 503, "sign-in unavailable", escape(f"Cannot sign in now: {e}"), {"Set-Cookie": clear}
        )
    except oidc.IdTokenRefused as e:
        _log.warning("signon_refused", reason=str(e), client=h.client_address[0])
        return _page(
            h,
            401,
            "not signed in",
            escape(f"Not signed in: {e}. ") + '<a href="/login">Try again</a>.',
            {"Set-Cookie": clear},
        )
    who = session.who
    _log.info(
        "signed_on", actor=who.name, sub=who.subject, role=who.role, client=h.client_address[0]
    )
    cookies = [set_cookie(h, SESSION_COOKIE, sid, s.cfg.session_s), clear]
    return _page(h, 303, "signed in", "Signed in.", {"Location": next_path, "Set-Cookie": cookies})


def logout(h):
    """POST /logout: this browser's session ends here (the provider's own session is
    the provider's)."""
    s = h.signon
    who = s.end(cookie(h, SESSION_COOKIE)) if s is not None else None
    if who is not None:
        _log.info("signed_off", actor=who.name, sub=who.subject, client=h.client_address[0])
    headers = {"Set-Cookie": set_cookie(h, SESSION_COOKIE, "", 0)}
    link = ' <a href="/login">Sign in again</a>.' if s is not None else ""
    return _page(h, 200, "signed out", "Signed out." + link, headers)


def settings(h):
    """GET /v1/signon: what `llmgw login` needs to ask the provider for a token."""
    s = _signon(h)
    return 200, {"issuer": s.cfg.issuer, "client_id": s.cli_client_id, "scopes": s.cfg.scopes}
