"""`llmgw login` and `llmgw logout`: sign on through the identity provider ([oidc] on the
scheduler) instead of holding an operator's token.

`llmgw login` asks the scheduler which provider and client to use (GET /v1/signon), then
the provider for a device code (RFC 8628): it prints where to go and the code to enter,
and waits while the operator signs in there, in any browser on any machine. The ID token
it gets is checked by the scheduler (GET /v1/whoami: the role the claims give) and only
then kept (logins.py). `--token` takes an ID token got some other way, pasted.
"""

import sys
import time

import click
import requests
from authlib.integrations.base_client import OAuthError
from authlib.integrations.requests_client import OAuth2Session

from llmgw import oidc
from llmgw_ctl import logins
from llmgw_ctl.api import LOGIN, Admin, anonymous, base_url, ca_bundle
from llmgw_ctl.common import pass_state, print_json

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
SLOW_DOWN_S = 5.0  # RFC 8628 3.5: what a `slow_down` adds to the polling interval


@click.command("login")
@click.option(
    "--token",
    "pasted",
    is_flag=True,
    help="Paste an ID token from the provider (read from stdin) instead.",
)
@click.option("--json", "as_json", is_flag=True, help="Print who you are signed on as, as JSON.")
@pass_state
def login(state, pasted, as_json):
    """Sign on through the identity provider; the ID token is kept (0600) for this
    scheduler's admin URL and sent by every later command.

    Prints a URL and a code: open the URL in a browser, anywhere, enter the code and
    sign in. The role comes from the provider's claims, as [oidc] on the scheduler says.

    \b
    Examples:
      llmgw login
      llmgw --admin-url https://sched.example.org:8081 login
      pbpaste | llmgw login --token
    """
    url = base_url(state)
    settings = anonymous(state).get("/v1/signon")
    if pasted:
        token = {"id_token": _read_pasted()}
    else:
        token = device_flow(settings)
    id_token = token.get("id_token")
    if not id_token:
        raise click.ClickException(f"{settings['issuer']} gave no ID token: is 'openid' asked?")
    who = Admin(url, id_token, LOGIN, verify=ca_bundle(state)).get("/v1/whoami")
    entry = logins.entry_for(id_token, token, settings, who)
    file = logins.save(url, entry)
    if as_json:
        print_json(
            {
                "admin_url": url,
                "name": who["name"],
                "role": who["role"],
                "via": who.get("via"),
                "expires_at": entry.get("expires_at"),
            }
        )
        return
    ends = entry.get("expires_at")
    until = time.strftime("%Y-%m-%d %H:%M", time.localtime(ends)) if ends else "?"
    renew = ", then renewed" if entry.get("refresh_token") else ""
    click.echo(
        f"signed on at {url} as {who['name']} ({who['role']}); the token is kept in"
        f" {file} until {until}{renew}",
        err=True,
    )


@click.command("logout")
@pass_state
def logout(state):
    """Forget the ID token kept for this scheduler's admin URL."""
    url = base_url(state)
    entry = logins.forget(url)
    if entry is None:
        click.echo(f"not signed on at {url}", err=True)
    else:
        click.echo(f"signed off at {url} ({entry.get('name')})", err=True)


def _read_pasted() -> str:
    if sys.stdin.isatty():
        text = click.prompt("ID token", hide_input=True, err=True)
    else:
        text = sys.stdin.readline()
    text = text.strip()
    if not oidc.looks_like_jwt(text):
        raise click.ClickException("that is not an ID token (a JWT: three base64url parts)")
    return text


def device_flow(settings: dict) -> dict:
    """The provider's tokens once the operator approves the device code."""
    client_id, scope = settings["client_id"], " ".join(settings.get("scopes") or ["openid"])
    try:
        provider = oidc.Provider(settings["issuer"])
        start_url = provider.endpoint("device_authorization_endpoint")
        token_url = provider.endpoint("token_endpoint")
    except oidc.SignOnError as e:
        raise click.ClickException(str(e)) from None
    try:
        r = requests.post(
            start_url, data={"client_id": client_id, "scope": scope}, timeout=oidc.TIMEOUT_S
        )
        start = r.json()
    except (requests.RequestException, ValueError) as e:
        raise click.ClickException(f"cannot ask {start_url} for a device code: {e}") from None
    if r.status_code != 200 or "device_code" not in start:
        raise click.ClickException(
            f"{start_url} refused a device code for client {client_id}:"
            f" {start.get('error')} {start.get('error_description') or ''}".strip()
        )
    click.echo(
        f"To sign in, open {start['verification_uri']} and enter the code {start['user_code']}",
        err=True,
    )
    if start.get("verification_uri_complete"):
        click.echo(f"(or open {start['verification_uri_complete']})", err=True)
    interval = float(start.get("interval") or 5)
    deadline = time.monotonic() + float(start.get("expires_in") or 600)
    with OAuth2Session(client_id, token_endpoint_auth_method="none") as client:
        while time.monotonic() < deadline:
            time.sleep(interval)
            try:
                return client.fetch_token(
                    token_url,
                    grant_type=DEVICE_GRANT,
                    device_code=start["device_code"],
                    timeout=oidc.TIMEOUT_S,
                )
            except OAuthError as e:
                if e.error == "authorization_pending":
                    continue
                if e.error == "slow_down":
                    interval += SLOW_DOWN_S
                    continue
                raise click.ClickException(
                    f"not signed in: {e.error} {e.description or ''}".strip()
                ) from None
            except requests.RequestException as e:
                raise click.ClickException(f"cannot reach {token_url}: {e}") from None
    raise click.ClickException("not signed in: the code expired; run `llmgw login` again")
