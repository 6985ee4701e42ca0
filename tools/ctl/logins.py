"""The ID tokens `llmgw login` got, one per admin URL, in the operator's own state file:
$XDG_STATE_HOME/llmgw/login.json (~/.local/state/llmgw/login.json), 0600 in a 0700
directory, replaced in one rename. A token near its end is refreshed with the refresh
token the provider gave with it, if it gave one; else the operator is told to sign in
again. Nothing here trusts a token: the scheduler checks it at every call.
"""

import json
import os
import time
from pathlib import Path

import click
import requests
from authlib.integrations.base_client import OAuthError
from authlib.integrations.requests_client import OAuth2Session

from llmgw import oidc

REFRESH_BEFORE_S = 60.0  # a token this close to its end is refreshed before it is sent


def path() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "llmgw" / "login.json"


def _read() -> dict:
    try:
        data = json.loads(path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot read the sign-on file {path()}: {e}") from None
    return data if isinstance(data, dict) else {}


def _write(data: dict) -> None:
    file = path()
    try:
        file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = file.with_name(file.name + ".part")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o600)  # O_CREAT's mode is for a new file only
        tmp.replace(file)
    except OSError as e:
        raise click.ClickException(f"cannot write the sign-on file {file}: {e.strerror}") from None


def save(url: str, entry: dict) -> Path:
    data = _read()
    data[url] = entry
    _write(data)
    return path()


def forget(url: str) -> dict | None:
    data = _read()
    entry = data.pop(url, None)
    if entry is not None:
        _write(data)
    return entry


def entry_for(id_token: str, token: dict, settings: dict, who: dict) -> dict:
    """What is kept of one sign-on."""
    claims = oidc.unverified_claims(id_token)
    return {
        "id_token": id_token,
        "refresh_token": token.get("refresh_token"),
        "issuer": settings.get("issuer") or claims.get("iss"),
        "client_id": settings.get("client_id") or "",
        "expires_at": claims.get("exp"),
        "name": who.get("name"),
        "role": who.get("role"),
    }


def token(url: str, now: float | None = None) -> str | None:
    """The ID token kept for `url`, refreshed if it is about to end; None if there is
    none; ClickException if it has ended and cannot be refreshed."""
    entry = _read().get(url)
    if not isinstance(entry, dict) or not entry.get("id_token"):
        return None
    now = time.time() if now is None else now
    expires = entry.get("expires_at")
    if not isinstance(expires, int | float) or now < expires - REFRESH_BEFORE_S:
        return entry["id_token"]
    if entry.get("refresh_token"):
        return _refresh(url, entry)
    raise click.ClickException(
        f"your sign-on as {entry.get('name')} at {url} ended"
        f" {time.strftime('%Y-%m-%d %H:%M', time.localtime(expires))}: run `llmgw login`"
    )


def _refresh(url: str, entry: dict) -> str:
    try:
        endpoint = oidc.Provider(entry["issuer"]).endpoint("token_endpoint")
        with OAuth2Session(entry["client_id"], token_endpoint_auth_method="none") as client:
            fresh = client.refresh_token(
                endpoint, refresh_token=entry["refresh_token"], timeout=oidc.TIMEOUT_S
            )
    except (OAuthError, requests.RequestException, oidc.SignOnError) as e:
        raise click.ClickException(
            f"your sign-on as {entry.get('name')} at {url} ended and could not be renewed"
            f" ({e}): run `llmgw login`"
        ) from None
    if not fresh.get("id_token"):
        raise click.ClickException(
            f"{entry['issuer']} renewed the sign-on without an ID token: run `llmgw login`"
        )
    entry = {
        **entry,
        "id_token": fresh["id_token"],
        "refresh_token": fresh.get("refresh_token") or entry["refresh_token"],
        "expires_at": oidc.unverified_claims(fresh["id_token"]).get("exp"),
    }
    save(url, entry)
    return entry["id_token"]
