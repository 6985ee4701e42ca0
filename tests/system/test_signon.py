"""Sign-on through a real OpenID Connect provider (oidc-provider from npm, on loopback):
the status page's code flow with PKCE, ID tokens on the admin API and their roles, the
audit log naming the person, `llmgw login` by device code and by a pasted token.

The admin API is the real server in front of the real scheduler in this process (as in
tests/unit/test_admin_routes.py); its sign-on's clock can be moved, the provider's not.
"""

import json
import os
import stat
import subprocess
import time
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
import requests

from llmgw import operators
from llmgw.config import OidcConfig
from llmgw_ctl import logins
from llmgw_scheduler import admin
from llmgw_scheduler.signon import SignOn
from tests.fake_fleet import Fleet, model
from tests.helpers import BIN, free_port, llmgw
from tests.oidc import (
    SECRET,
    Provider,
    cli_client,
    device_approve,
    device_token,
    sign_in,
    web_client,
)

TOKEN = "t" * 32


class Clock:
    """Wall time, moved on by a test: the sign-on's, not the provider's."""

    def __init__(self):
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.time() + self.ahead


@pytest.fixture
def site(tmp_path):
    """The admin API with sign-on, its provider and what a test needs of both."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    op = Provider(tmp_path, [web_client(f"{base}/oidc/callback"), cli_client(),
                             cli_client("another-app")])  # fmt: skip
    cfg = OidcConfig(issuer=op.issuer, client_id="llmgw", client_secret=SECRET,
                     redirect_url=f"{base}/oidc/callback", cli_client_id="llmgw-cli")  # fmt: skip
    clock = Clock()
    fleet = Fleet(tmp_path, [model("m")])
    fleet.heartbeat("a", kind="hello")
    server = admin.serve(fleet.sched, f"127.0.0.1:{port}", TOKEN, signon=SignOn(cfg, clock=clock))
    yield SimpleNamespace(base=base, op=op, clock=clock, cfg=cfg, tmp=tmp_path)
    server.shutdown()
    server.server_close()
    fleet.close()
    op.stop()


def call(site, method: str, path: str, token: str, body: dict | None = None):
    return requests.request(method, site.base + path, json=body, timeout=10,
                            headers={"Authorization": f"Bearer {token}"})  # fmt: skip


def audit_rows(site) -> list[dict]:
    return call(site, "GET", "/v1/audit", TOKEN).json()


def browser_sign_in(site, browser: requests.Session, login: str):
    """From the page, through the provider's login and consent, to the answer of
    /oidc/callback: (that answer, every answer on the way)."""
    seen = []

    def at_callback(resp):
        seen.append(resp)
        return urlsplit(resp.url).path == "/oidc/callback"

    resp = browser.get(f"{site.base}/status", allow_redirects=False, timeout=10)
    return sign_in(browser, resp, login, at_callback), seen


def cookie_parts(resp: requests.Response, name: str) -> set[str]:
    [header] = [c for c in resp.raw.headers.getlist("Set-Cookie") if c.startswith(name + "=")]
    return {part.strip() for part in header.split(";")}


# -- the status page ----------------------------------------------------------------------


def test_a_browser_signs_in_with_pkce_and_reaches_the_page_with_its_role(site):
    with requests.Session() as browser:
        back, seen = browser_sign_in(site, browser, "ada")
        first, to_provider = seen[0], seen[1]
        assert first.status_code == 303 and first.headers["Location"] == "/login?next=%2Fstatus"
        asked = parse_qs(urlsplit(to_provider.headers["Location"]).query)
        assert asked["code_challenge_method"] == ["S256"] and len(asked["code_challenge"][0]) == 43
        assert asked["client_id"] == ["llmgw"] and asked["nonce"] and asked["state"]
        assert cookie_parts(to_provider, "llmgw_login") >= {"HttpOnly", "SameSite=Lax"}

        assert back.status_code == 303 and back.headers["Location"] == "/status"
        session = cookie_parts(back, "llmgw_session")
        assert {"HttpOnly", "SameSite=Lax", "Path=/", "Max-Age=28800"} <= session
        assert "Secure" not in session, "plain HTTP: a Secure cookie would never come back"
        assert "Max-Age=0" in cookie_parts(back, "llmgw_login"), "the binding is spent"

        page = browser.get(f"{site.base}/status", allow_redirects=False, timeout=10)
        assert page.status_code == 200
        assert "signed in as ada@example.org (admin)" in page.text
        assert 'action="/logout"' in page.text


def test_a_person_with_no_role_is_refused_with_the_reason_and_no_session(site):
    with requests.Session() as browser:
        back, _ = browser_sign_in(site, browser, "eve")
        assert back.status_code == 403
        assert "eve@example.org is signed in" in back.text
        assert "none of llmgw-admins, llmgw-readers" in back.text
        assert "llmgw_session" not in browser.cookies
        page = browser.get(f"{site.base}/status", allow_redirects=False, timeout=10)
        assert page.status_code == 303, "still not signed in"


def test_signing_out_ends_the_session_and_the_same_cookie_opens_nothing_after(site):
    with requests.Session() as browser:
        browser_sign_in(site, browser, "bob")
        sid = browser.cookies["llmgw_session"]
        page = browser.get(f"{site.base}/status", allow_redirects=False, timeout=10)
        assert "signed in as bob@example.org (read)" in page.text
        out = browser.post(f"{site.base}/logout", allow_redirects=False, timeout=10)
        assert out.status_code == 200 and "Max-Age=0" in cookie_parts(out, "llmgw_session")
    replayed = requests.get(f"{site.base}/status", cookies={"llmgw_session": sid},
                            allow_redirects=False, timeout=10)  # fmt: skip
    assert replayed.status_code == 303 and replayed.headers["Location"].startswith("/login")


def test_a_session_ends_after_its_lifetime_whatever_the_browser_keeps(site):
    with requests.Session() as browser:
        browser_sign_in(site, browser, "ada")
        assert browser.get(f"{site.base}/status", timeout=10).status_code == 200
        site.clock.ahead = site.cfg.session_s + 1
        page = browser.get(f"{site.base}/status", allow_redirects=False, timeout=10)
        assert page.status_code == 303 and page.headers["Location"].startswith("/login")


def test_a_callback_that_another_browser_began_is_refused(site):
    """Login CSRF: an attacker's own code, planted in a victim's browser, must not sign
    the victim in as the attacker."""
    with requests.Session() as attacker:
        resp = attacker.get(f"{site.base}/login", allow_redirects=False, timeout=10)
        before = sign_in(
            attacker, resp, "ada", lambda r: "/oidc/callback" in r.headers.get("Location", "")
        )
        callback = before.headers["Location"]
    with requests.Session() as victim:
        resp = victim.get(callback, allow_redirects=False, timeout=10)
        assert resp.status_code == 401 and "not one this browser began" in resp.text
        assert "llmgw_session" not in victim.cookies


# -- the admin API ------------------------------------------------------------------------


def test_an_admins_id_token_makes_a_change_and_the_audit_names_the_person(site):
    token = device_token(site.op, "ada")["id_token"]
    me = call(site, "GET", "/v1/whoami", token).json()
    assert me == {"name": "ada@example.org", "role": "admin", "via": "oidc"}
    resp = call(site, "POST", "/v1/models/m/scale", token, {"min": 0, "max": 2})
    assert resp.status_code == 202, resp.text
    row = audit_rows(site)[-1]
    assert (row["action"], row["actor"], row["target"]) == ("models.scale", "ada@example.org", "m")
    assert row["detail"]["via"] == "oidc" and row["detail"]["sub"] == "ada"


def test_a_readers_id_token_may_look_but_a_change_is_refused_403_and_audited(site):
    token = device_token(site.op, "bob")["id_token"]
    assert call(site, "GET", "/v1/status", token).status_code == 200
    resp = call(site, "POST", "/v1/models/m/scale", token, {"min": 0, "max": 2})
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "forbidden"
    assert "'bob@example.org' has the read role" in resp.json()["error"]["message"]
    row = audit_rows(site)[-1]
    assert (row["action"], row["actor"]) == ("models.scale_refused", "bob@example.org")
    assert row["detail"]["sub"] == "bob" and row["detail"]["role"] == operators.READ


def test_an_id_token_with_no_role_is_refused_403_saying_what_to_ask_for(site):
    token = device_token(site.op, "eve")["id_token"]
    resp = call(site, "GET", "/v1/status", token)
    assert resp.status_code == 403
    error = resp.json()["error"]
    assert error["code"] == "no_role"
    assert "'groups' claim" in error["message"] and "llmgw-readers" in error["message"]


def test_tokens_from_another_issuer_or_audience_or_expired_or_forged_are_refused_401(site):
    stranger = Provider(site.tmp, [cli_client()], name="stranger")
    try:
        foreign = device_token(stranger, "ada")["id_token"]
    finally:
        stranger.stop()
    elsewhere = device_token(site.op, "ada", client_id="another-app")["id_token"]
    good = device_token(site.op, "ada")["id_token"]
    head, body, sig = good.split(".")
    forged = f"{head}.{body}.{sig[:-4]}{'AAAA' if sig[-4:] != 'AAAA' else 'BBBB'}"

    def refused(token):
        resp = call(site, "GET", "/v1/status", token)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "unauthorized"
        return resp.json()["error"]["message"]

    assert f"issued by '{stranger.issuer}'" in refused(foreign)
    assert "issued for another-app, not for llmgw or llmgw-cli" in refused(elsewhere)
    assert "signature does not verify" in refused(forged)
    assert call(site, "GET", "/v1/status", good).status_code == 200
    site.clock.ahead = 3600 + 61  # the provider's ID tokens last an hour, give or take 60 s
    assert "expired" in refused(good)
    assert call(site, "GET", "/v1/status", TOKEN).status_code == 200, "tokens work beside it"


# -- llmgw login --------------------------------------------------------------------------


def ctl(site, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "llmgw"), "--admin-url", site.base, *args],
                          input=stdin, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LLMGW_ADMIN_TOKEN": ""})  # fmt: skip


def login_file(site):
    return site.tmp / "xdg-state" / "llmgw" / "login.json"


def test_llmgw_login_by_device_code_keeps_the_token_0600_and_later_commands_use_it(site):
    proc = subprocess.Popen([str(BIN / "llmgw"), "--admin-url", site.base, "login", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "LLMGW_ADMIN_TOKEN": ""})  # fmt: skip
    try:
        told = [proc.stderr.readline(), proc.stderr.readline()]
        assert told[0].startswith(f"To sign in, open {site.op.issuer}/device and enter the code")
        complete = told[1].strip().removeprefix("(or open ").removesuffix(")")
        device_approve(complete, "ada")
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out)["name"] == "ada@example.org" and json.loads(out)["role"] == "admin"
    file = login_file(site)
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    assert stat.S_IMODE(file.parent.stat().st_mode) == 0o700

    scaled = ctl(site, "scale", "m", "--min", "0", "--max", "2")
    assert scaled.returncode == 0, scaled.stderr
    row = audit_rows(site)[-1]
    assert (row["action"], row["actor"]) == ("models.scale", "ada@example.org")

    out = ctl(site, "logout")
    assert out.returncode == 0 and "signed off" in out.stderr
    assert site.base not in json.loads(file.read_text())
    assert ctl(site, "status").returncode != 0, "no token left to send"


def test_llmgw_login_takes_a_pasted_token_and_keeps_none_that_gives_no_role(site):
    bob = device_token(site.op, "bob")["id_token"]
    out = ctl(site, "login", "--token", stdin=bob + "\n")
    assert out.returncode == 0, out.stderr
    assert "as bob@example.org (read)" in out.stderr
    assert json.loads(login_file(site).read_text())[site.base]["id_token"] == bob
    refused = ctl(site, "scale", "m", "--min", "0", "--max", "2")
    assert refused.returncode == 1 and "has the read role" in refused.stderr

    eve = device_token(site.op, "eve")["id_token"]
    out = ctl(site, "login", "--token", stdin=eve + "\n")
    assert out.returncode == 1 and "none of llmgw-admins, llmgw-readers" in out.stderr
    assert json.loads(login_file(site).read_text())[site.base]["id_token"] == bob, "kept bob's"
    out = ctl(site, "login", "--token", stdin="not-a-token\n")
    assert out.returncode == 1 and "not an ID token" in out.stderr


def test_a_kept_token_near_its_end_is_renewed_with_its_refresh_token_or_the_operator_told(site):
    token = device_token(site.op, "ada", scope="openid email groups offline_access")
    settings = {"issuer": site.op.issuer, "client_id": "llmgw-cli"}
    entry = logins.entry_for(token["id_token"], token, settings, {"name": "ada@example.org"})
    logins.save(site.base, {**entry, "expires_at": time.time()})  # about to end
    out = ctl(site, "status", "--json")
    assert out.returncode == 0, out.stderr
    kept = json.loads(login_file(site).read_text())[site.base]
    # Renewed: the kept entry ends an hour on, not now. (Not "another token": a renewal in
    # the same second as the sign-on gets a byte-identical ID token, RS256 being
    # deterministic.)
    assert kept["expires_at"] > time.time() + 600

    logins.save(site.base, {**kept, "refresh_token": None, "expires_at": time.time() - 1})
    out = ctl(site, "status")
    assert out.returncode == 1
    assert "your sign-on as ada@example.org" in out.stderr and "run `llmgw login`" in out.stderr


# -- the real scheduler ---------------------------------------------------------------------


def test_the_scheduler_configured_with_oidc_signs_a_browser_in_to_its_page(cluster, tmp_path):
    base = f"http://127.0.0.1:{cluster.admin_port}"
    op = Provider(tmp_path, [web_client(f"{base}/oidc/callback")])
    try:
        secret = tmp_path / "oidc.secret"
        secret.write_text(SECRET + "\n")
        cluster.scheduler_extra = (
            f'[oidc]\nissuer = "{op.issuer}"\nclient_id = "llmgw"\n'
            f'client_secret = "@{secret}"\nredirect_url = "{base}/oidc/callback"\n'
        )
        cluster.start_scheduler()
        with requests.Session() as browser:
            resp = browser.get(f"{base}/", allow_redirects=False, timeout=10)
            back = sign_in(
                browser,
                resp,
                "bob",
                lambda r: urlsplit(r.url).port == cluster.admin_port and r.status_code == 200,
            )
            assert back.url == f"{base}/", "back where the browser began"
            assert "signed in as bob@example.org (read)" in back.text
        log = (tmp_path / "scheduler.log").read_text()
        assert "signed_on" in log and "bob@example.org" in log
    finally:
        op.stop()


def test_llmgw_login_without_sign_on_configured_says_so(cluster):
    cluster.start_scheduler()
    out = llmgw("--admin-url", f"http://127.0.0.1:{cluster.admin_port}", "login", check=False)
    assert out.returncode == 1
    assert "sign-on is not configured on this scheduler" in out.stderr
