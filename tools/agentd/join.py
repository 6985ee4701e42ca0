"""`llmgw-agentd join URL TOKEN --ca-sha256 FP`: this node joins the fleet by itself.

1. The control plane's CA is fetched from URL and checked against FP, the fingerprint
   the operator got with the token. A different CA stops here, before the token is sent
   anywhere: a token shown to the wrong server could be used by it.
2. This node makes its own CURVE keypair; the secret half never leaves it.
3. The token and the public key go to URL over HTTPS verified by that CA. The scheduler
   registers the key under the name the token was made for and answers with its own
   public key and its bus port.
4. The keys, the CA and (when there is no config file yet) a config naming this node
   and its scheduler are written; `llmgw-agentd` can start.
"""

import shutil
import tempfile
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import requests
import urllib3
import zmq.auth

from llmgw import bus, jointokens
from llmgw.config import Config
from llmgw.errors import Error, Invalid
from llmgw_agentd.errors import AgentError

TIMEOUT_S = 15.0


class JoinError(AgentError):
    """This node could not join: the CA, the token or the control plane said no."""


def _fail(e: requests.RequestException, url: str) -> JoinError:
    return JoinError(f"cannot reach {url}: {type(e).__name__}: {str(e)[:200]}")


def fetch_ca(url: str, fingerprint: str) -> str:
    """The CA at `url`, if its fingerprint is `fingerprint`; JoinError otherwise."""
    try:
        with warnings.catch_warnings():
            # Not verified on purpose: what we get is checked by its fingerprint below.
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            r = requests.get(f"{url}/v1/join/ca", verify=False, timeout=TIMEOUT_S)
    except requests.RequestException as e:
        raise _fail(e, url) from None
    if r.status_code != 200:
        raise JoinError(f"{url} would not give its CA: {_message(r)}")
    try:
        pem = r.json()["ca"]
        got = jointokens.fingerprint(pem)
    except (ValueError, KeyError, TypeError):
        raise JoinError(f"{url} answered /v1/join/ca without a CA certificate") from None
    if got != fingerprint:
        raise JoinError(
            f"the CA at {url} has sha256 {got}, not {fingerprint}: refusing to join"
            " (wrong address, or someone in between); the token was not sent"
        )
    return pem


def _message(r: requests.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"


def join(cfg: Config, config_file: Path, url: str, token: str, ca_sha256: str) -> str:
    """Join; the node's name. Raises JoinError (or Invalid) with one line."""
    url = url.rstrip("/")
    if urlsplit(url).scheme != "https":
        raise Invalid(f"{url}: the join URL must be https:// (the token must not go in the clear)")
    fp = jointokens.normal_fingerprint(ca_sha256)
    pem = fetch_ca(url, fp)
    curve = cfg.curve_dir()
    curve.mkdir(parents=True, exist_ok=True)
    ca_file = cfg.ca_file()
    ca_file.parent.mkdir(parents=True, exist_ok=True)
    ca_file.write_text(pem)
    with tempfile.TemporaryDirectory(dir=curve, prefix=".join-") as tmp:
        public_file, secret_file = zmq.auth.create_certificates(tmp, "node")
        public, _ = zmq.auth.load_certificate(public_file)
        try:
            body = {"token": token, "public_key": public.decode()}
            r = requests.post(f"{url}/v1/join", json=body, verify=str(ca_file), timeout=TIMEOUT_S)
        except requests.RequestException as e:
            raise _fail(e, url) from None
        if r.status_code != 201:
            raise JoinError(f"{url} refused to let this node join: {_message(r)}")
        body = r.json()
        name = str(body["name"])
        shutil.move(secret_file, curve / f"{name}.key_secret")
        shutil.move(public_file, curve / f"{name}.key")
        (curve / f"{name}.key_secret").chmod(0o600)
    (curve / f"{bus.SCHEDULER}.key").write_text(body["scheduler_key"])
    scheduler = f"tcp://{urlsplit(url).hostname}:{int(body['bus_port'])}"
    _configure(config_file, name, scheduler)
    return name


def _configure(config_file: Path, name: str, scheduler: str) -> None:
    """Name this node and its scheduler in the config, unless it names them already
    (then say what to set: a config the operator wrote is theirs)."""
    lines = f'[agent]\nname = "{name}"\nschedulers = ["{scheduler}"]\n'
    text = config_file.read_text() if config_file.exists() else ""
    if "[agent]" in text:
        raise JoinError(
            f"joined as {name}, but {config_file} has an [agent] table already: set"
            f' name = "{name}" and schedulers = ["{scheduler}"] there'
        )
    try:
        config_file.parent.mkdir(parents=True, exist_ok=True)
        with open(config_file, "a") as f:
            f.write(("\n" if text and not text.endswith("\n") else "") + lines)
    except OSError as e:
        raise JoinError(f"joined as {name}, but cannot write {config_file}: {e.strerror}") from None


def run(cfg: Config, config_file: Path, url: str, token: str, ca_sha256: str) -> str:
    try:
        return join(cfg, config_file, url, token, ca_sha256)
    except (Error, OSError) as e:
        raise JoinError(str(e)) from None
