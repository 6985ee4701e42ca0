"""The scheduler's admin API, as `llmgw` calls it: where it is, its token, one-line errors."""

import getpass
import json
import os
import socket
from pathlib import Path
from urllib.parse import quote

import click
import requests
from click.core import ParameterSource

from llmgw_ctl import logins

# Long enough for a scheduler busy placing a large fleet, short enough that an operator
# is not left staring at a terminal that looks hung.
TIMEOUT_S = 5.0
DEFAULT_LISTEN = "127.0.0.1:8081"
HINT = "is llmgw-scheduler running? set --admin-url or LLMGW_ADMIN_URL"


class Admin:
    """A client of the admin API; every failure becomes a one-line ClickException."""

    def __init__(self, url: str, token: str, token_from: str, verify=True):
        self.url = url.rstrip("/")
        self.token = token
        self.token_from = token_from
        self.verify = verify  # for https: the cluster CA's file, or True for the system's

    def get(self, path: str, **params):
        return self._call("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict | None = None, timeout_s: float = TIMEOUT_S):
        return self._call("POST", path, body=body, timeout_s=timeout_s)

    def delete(self, path: str):
        return self._call("DELETE", path)

    def upload(self, path: str, file: Path, timeout_s: float = 120.0):
        """POST a file's bytes (a wheel) as the body."""
        with open(file, "rb") as f:
            return self._call("POST", path, data=f, timeout_s=timeout_s)

    def download(self, path: str, timeout_s: float = 120.0) -> bytes:
        """GET raw bytes (a release's wheel)."""
        return self._request("GET", path, None, None, None, timeout_s).content

    def stream(self, path: str, body: dict):
        """POST, then yield each JSON line of the answer as it comes (a long pull)."""
        r = self._request("POST", path, None, body, None, (TIMEOUT_S, None), stream=True)
        with r:
            try:
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
            except (requests.RequestException, ValueError) as e:
                raise click.ClickException(
                    f"the scheduler at {self.url} stopped answering {path} midway: {e}"
                ) from None

    def _call(self, method, path, params=None, body=None, data=None, timeout_s=TIMEOUT_S):
        r = self._request(method, path, params, body, data, timeout_s)
        try:
            return r.json()
        except ValueError:
            raise click.ClickException(
                f"{self.url} answered {method} {path} with HTTP {r.status_code} and no JSON:"
                f" is it llmgw-scheduler's admin API? ({HINT})"
            ) from None

    def _request(self, method, path, params, body, data, timeout_s, stream=False):
        headers = {"X-Llmgw-Actor": actor()}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
        try:
            r = requests.request(
                method,
                self.url + path,
                params=params,
                json=body,
                data=data,
                headers=headers,
                verify=self.verify,
                timeout=timeout_s,
                stream=stream,
            )
        except requests.RequestException as e:
            raise click.ClickException(
                f"cannot reach the scheduler at {self.url}: {reason(e)} ({HINT})"
            ) from None
        if r.status_code == 401 and self.token_from == LOGIN:
            raise click.ClickException(
                f"the scheduler at {self.url} refused your sign-on: {error_message(r)}"
                " (run `llmgw login` again)"
            )
        if r.status_code == 401:
            raise click.ClickException(
                f"the scheduler at {self.url} refused the admin token from {self.token_from}"
                " (it must be an operator's token from `llmgw operators add`, the bootstrap"
                " token: scheduler.admin_token, or <config_dir>/secrets/admin.token on the"
                " scheduler's host, or an ID token from `llmgw login`)"
            )
        if r.status_code >= 400:
            raise click.ClickException(error_message(r))
        return r


def actor() -> str:
    """Who is making a change, for the audit log: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def error_message(r: requests.Response) -> str:
    """The API's own message, else the status line."""
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    return str(message).strip().replace("\n", " ") or f"HTTP {r.status_code} {r.reason}"


def reason(e: requests.RequestException) -> str:
    """A few words for why a request failed: 'Connection refused', not urllib3's repr."""
    if isinstance(e, requests.Timeout):
        return f"no answer within {TIMEOUT_S:g}s"
    seen, todo = set(), [e]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.strerror:
            return exc.strerror
        todo += [exc.__cause__, exc.__context__, getattr(exc, "reason", None)]
        todo += [a for a in exc.args if isinstance(a, BaseException)]
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def base_url(state) -> str:
    """--admin-url / LLMGW_ADMIN_URL, else http:// + scheduler.admin_listen."""
    if state.admin_url:
        url = state.admin_url
    else:
        listen = getattr(state.cfg.scheduler, "admin_listen", "") or DEFAULT_LISTEN
        host, _, port = listen.rpartition(":")
        # A scheduler listening on every address is reached on this machine's loopback.
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        url = f"{host}:{port}"
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


LOGIN = "llmgw login"


def token(state) -> tuple[str, str]:
    """(token, where it came from): --token / LLMGW_ADMIN_TOKEN, the ID token `llmgw login`
    kept for this admin URL, the config, the token file."""
    if state.admin_token:
        ctx = click.get_current_context(silent=True)
        root = ctx.find_root() if ctx else None
        source = root.get_parameter_source("admin_token") if root else None
        return state.admin_token, (
            "LLMGW_ADMIN_TOKEN" if source == ParameterSource.ENVIRONMENT else "--token"
        )
    signed_on = logins.token(base_url(state))
    if signed_on:
        return signed_on, LOGIN
    cfg = state.cfg
    configured = getattr(cfg.scheduler, "admin_token", "")
    if configured:
        return configured, f"scheduler.admin_token in {cfg.source or 'the config'}"
    path = Path(cfg.paths.config_dir) / "secrets" / "admin.token"
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise click.ClickException(
            f"no admin token: pass --token, set LLMGW_ADMIN_TOKEN, or set scheduler.admin_token"
            f" (the scheduler writes one to {path} on its first start)"
        ) from None
    except OSError as e:
        raise click.ClickException(
            f"cannot read the admin token from {path}: {e.strerror}"
            " (run as its owner, or pass --token or set LLMGW_ADMIN_TOKEN)"
        ) from None
    if not text:
        raise click.ClickException(f"the admin token file {path} is empty")
    return text, str(path)


def client(state) -> Admin:
    """The admin API for this invocation's --admin-url, --token and config."""
    url = base_url(state)
    secret, source = token(state)
    return Admin(url, secret, source, verify=ca_bundle(state))


def anonymous(state) -> Admin:
    """The admin API without a credential: for its public routes (sign-on's settings)."""
    return Admin(base_url(state), "", "no token", verify=ca_bundle(state))


def ca_bundle(state):
    """What https is verified against: LLMGW_CA, else the cluster CA if this machine has
    it (<config_dir>/pki/ca.crt), else the system's CAs."""
    if os.environ.get("LLMGW_CA"):
        return os.environ["LLMGW_CA"]
    ca = state.cfg.ca_file()
    return str(ca) if ca.exists() else True


def model_path(name: str, action: str) -> str:
    return f"/v1/models/{quote(name, safe='')}/{action}"
