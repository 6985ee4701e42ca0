"""A real OpenID Connect provider for the sign-on tests, and a browser that signs in.

The provider is `oidc-provider` from npm (a certified implementation), run by node from
tests/oidc_provider.mjs on a loopback port. npm installs the pinned version once under
the cache directory ($LLMGW_CACHE or ~/.cache/llmgw, beside the engine builds), never in
the repository; a test is skipped only when npm cannot reach its registry.
"""

import fcntl
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin

import pytest
import requests

from tests.helpers import ROOT, eventually, free_port

VERSION = "9.13.3"
CACHE = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw") / "npm"
LAUNCHER = ROOT / "tests" / "oidc_provider.mjs"
# What npm says when the registry cannot be reached: only then is a test skipped.
OFFLINE = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ETIMEDOUT", "ECONNRESET", "ENETUNREACH")

ADMINS, READERS = "llmgw-admins", "llmgw-readers"
ACCOUNTS = {
    "ada": {"email": "ada@example.org", "email_verified": True, "groups": [ADMINS]},
    "bob": {"email": "bob@example.org", "email_verified": True, "groups": [READERS, "staff"]},
    "eve": {"email": "eve@example.org", "email_verified": True, "groups": ["staff"]},
}
SECRET = "llmgw-test-client-secret"
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


def installed() -> Path:
    """node_modules holding oidc-provider VERSION, installed once (a lock serialises
    concurrent test runs); pytest.skip if npm cannot reach its registry."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have node and npm: the OpenID Connect tests may not skip")
        pytest.skip("node and npm are needed to run the OpenID Connect provider")
    modules = CACHE / VERSION / "node_modules"
    marker = modules / "oidc-provider" / "package.json"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and json.loads(marker.read_text())["version"] == VERSION:
            return modules
        out = subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(CACHE / VERSION),
                "--no-audit",
                "--no-fund",
                "--no-save",
                f"oidc-provider@{VERSION}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            if any(code in out.stderr for code in OFFLINE):
                pytest.skip(f"npm cannot reach its registry for oidc-provider: {out.stderr[-300:]}")
            raise RuntimeError(f"npm install oidc-provider@{VERSION} failed:\n{out.stderr}")
    return modules


class Provider:
    """One provider process. `clients`: client metadata as oidc-provider takes it."""

    def __init__(
        self, tmp: Path, clients: list[dict], accounts: dict | None = None, name: str = "op"
    ):
        self.port = free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        setup = tmp / f"{name}.json"
        setup.write_text(
            json.dumps({"port": self.port, "clients": clients, "accounts": accounts or ACCOUNTS})
        )
        self.log = tmp / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                ["node", str(LAUNCHER), str(installed()), str(setup)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        eventually(self._up, timeout=30, what=f"the OpenID provider on {self.port} ({self.log})")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the provider exited: {self.log.read_text()[-2000:]}")
        url = f"{self.issuer}/.well-known/openid-configuration"
        return requests.get(url, timeout=2).status_code == 200

    def metadata(self) -> dict:
        return requests.get(f"{self.issuer}/.well-known/openid-configuration", timeout=5).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def web_client(redirect_url: str, client_id: str = "llmgw") -> dict:
    """The confidential client the status page signs people in with."""
    return {
        "client_id": client_id,
        "client_secret": SECRET,
        "redirect_uris": [redirect_url],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
    }


def cli_client(client_id: str = "llmgw-cli") -> dict:
    """The public client `llmgw login` asks with by the device flow."""
    return {
        "client_id": client_id,
        "token_endpoint_auth_method": "none",
        "grant_types": [DEVICE_GRANT, "refresh_token"],
        "response_types": [],
        "redirect_uris": [],
    }


class Forms(HTMLParser):
    """The forms of a page: each its action, method and inputs' names and values."""

    def __init__(self, text: str):
        super().__init__()
        self.forms: list[dict] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            self.forms.append(
                {
                    "action": a.get("action") or "",
                    "method": (a.get("method") or "get").lower(),
                    "fields": {},
                }
            )
        elif tag == "input" and self.forms and a.get("name"):
            self.forms[-1]["fields"][a["name"]] = a.get("value") or ""


def sign_in(
    browser: requests.Session, resp: requests.Response, login: str, until, limit: int = 20
) -> requests.Response:
    """Do what a person's browser does from `resp` on: follow each redirect, and submit
    each of the provider's pages (the device code's confirmation, the login, the
    consent) with `login` and any password, until `until(resp)` holds for an answer;
    that answer, not followed further."""
    for _ in range(limit):
        if until(resp):
            return resp
        if resp.is_redirect:
            where = urljoin(resp.url, resp.headers["Location"])
            resp = browser.get(where, allow_redirects=False, timeout=10)
            continue
        forms = [f for f in Forms(resp.text).forms if f["method"] == "post"]
        assert forms, f"no form to submit at {resp.url} ({resp.status_code}): {resp.text[:500]}"
        fields = dict(forms[0]["fields"])
        if fields.get("prompt") == "login":
            fields.update(login=login, password="any")
        action = urljoin(resp.url, forms[0]["action"])
        resp = browser.post(action, data=fields, allow_redirects=False, timeout=10)
    raise AssertionError(f"still not there after {limit} steps: {resp.url}")


def device_approve(verification_uri_complete: str, login: str) -> requests.Response:
    """A person approving a device code in their own browser."""
    with requests.Session() as browser:
        resp = browser.get(verification_uri_complete, allow_redirects=False, timeout=10)
        return sign_in(browser, resp, login, lambda r: "Sign-in Success" in r.text)


def device_token(
    provider: Provider,
    login: str,
    client_id: str = "llmgw-cli",
    scope: str = "openid email profile groups",
) -> dict:
    """Tokens for `login` by the device flow, asked and approved here (no llmgw code):
    a real token for tests of what the admin API does with one."""
    meta = provider.metadata()
    start = requests.post(
        meta["device_authorization_endpoint"],
        data={"client_id": client_id, "scope": scope},
        timeout=10,
    ).json()
    device_approve(start["verification_uri_complete"], login)
    resp = requests.post(
        meta["token_endpoint"],
        data={
            "grant_type": DEVICE_GRANT,
            "device_code": start["device_code"],
            "client_id": client_id,
        },
        timeout=10,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()
