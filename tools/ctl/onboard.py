"""`llmgw nodes onboard NAME --ssh [USER@]HOST[:PORT]`: make a machine a node, over SSH.

Everything happens with the system's `ssh` in BatchMode (no prompts: a key the host
refuses, or a host key that is not known, is a one-line failure) and through the admin
API, so it runs from wherever `llmgw` does:

1. the host answers, with Python 3.11 or newer;
2. the newest release (`llmgw release list`) is copied over and installed into a venv;
3. a new node joins with a one-time join token (`llmgw-agentd join`, so its secret key
   is made on the node and never travels); the config gets the node's address;
4. the agent is started: a systemd unit where systemd runs, else detached (and the
   command to supervise it is printed);
5. it waits for the node's hello, with the release's version.

A failure after the node joined removes it again: nothing is left half-registered.
Onboarding a node that is registered already upgrades it: steps 1, 2, 4 and 5.
"""

import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import click

from llmgw_ctl.api import Admin

SSH_TIMEOUT_S = 30
INSTALL_TIMEOUT_S = 900
UNIT = "llmgw-agentd.service"


class OnboardError(click.ClickException):
    """Onboarding stopped: the host, ssh or the control plane said no."""


@dataclass
class Remote:
    """A host reached with the system's ssh, never asking anything."""

    user_host: str
    port: int | None = None
    identity: Path | None = None
    options: tuple[str, ...] = ()

    @classmethod
    def parse(cls, target: str, identity: Path | None, options: tuple[str, ...]) -> "Remote":
        host, port = target, None
        if ":" in target.rpartition("@")[2]:
            host, _, p = target.rpartition(":")
            if not p.isdigit():
                raise click.BadParameter(f"{target!r}: want [USER@]HOST[:PORT]", param_hint="--ssh")
            port = int(p)
        return cls(host, port, identity, options)

    @property
    def host(self) -> str:
        return self.user_host.rpartition("@")[2]

    def argv(self, command: str) -> list[str]:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.identity:
            argv += ["-i", str(self.identity), "-o", "IdentitiesOnly=yes"]
        for opt in self.options:
            argv += ["-o", opt]
        return [*argv, "--", self.user_host, command]

    def run(self, command: str, what: str, data: bytes | None = None,
            timeout: float = SSH_TIMEOUT_S * 2) -> str:  # fmt: skip
        try:
            r = subprocess.run(self.argv(command), input=data, capture_output=True,
                               timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise OnboardError(f"{self.user_host}: {what}: no answer within {timeout:g}s") from None
        except FileNotFoundError:
            raise OnboardError("no ssh on this machine (apt-get install openssh-client)") from None
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip().splitlines()
            last = err[-1] if err else f"exit {r.returncode}"
            raise OnboardError(f"{self.user_host}: {what} failed: {last}")
        return r.stdout.decode(errors="replace")


@dataclass
class Layout:
    """Where things go on the node."""

    venv: str
    config: str
    state_dir: str
    python: str

    @property
    def config_dir(self) -> str:
        return str(Path(self.config).parent)


def newest_release(api: Admin) -> dict:
    releases = api.get("/v1/releases")
    if not releases:
        raise OnboardError(
            "no release to install: `make release`, then `llmgw release publish"
            " dist/llmgw-VERSION-py3-none-any.whl`"
        )
    return releases[-1]  # oldest first by PEP 440


def check_host(remote: Remote, layout: Layout) -> bool:
    """The host answers and has Python 3.11+; True if systemd runs there."""
    out = remote.run(
        f"{shlex.quote(layout.python)} -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'",
        "finding Python",
    ).strip()
    major, _, minor = out.partition(".")
    if not (major.isdigit() and minor.isdigit()) or (int(major), int(minor)) < (3, 11):
        raise OnboardError(
            f"{remote.host} has Python {out or 'unknown'} at {layout.python}; llmgw needs 3.11"
            " or newer (install python3.11 there, or pass --python)"
        )
    return remote.run("test -d /run/systemd/system && echo yes || echo no", "looking for systemd"
                      ).strip() == "yes"  # fmt: skip


def install(api: Admin, remote: Remote, layout: Layout, release: dict) -> None:
    wheel = api.download(f"/v1/releases/{quote(release['filename'], safe='')}")
    q = shlex.quote
    # A directory of its own: two onboardings of one host must not share (or delete) it.
    tmp = remote.run(f"d=$(mktemp -d /tmp/llmgw-onboard.XXXXXX) && cat > \"$d\"/"
                     f"{q(release['filename'])} && echo \"$d\"", "copying the release",
                     data=wheel).strip()  # fmt: skip
    remote.run(
        f"{q(layout.python)} -m venv {q(layout.venv)} && {q(layout.venv)}/bin/pip install"
        f" --quiet --disable-pip-version-check --upgrade {q(tmp + '/' + release['filename'])}"
        f" && rm -rf {q(tmp)}",
        f"installing llmgw {release['version']} into {layout.venv}",
        timeout=INSTALL_TIMEOUT_S,
    )


def join(api: Admin, remote: Remote, layout: Layout, name: str, agent_set: tuple[str, ...]):
    q = shlex.quote
    t = api.post(f"/v1/nodes/{quote(name, safe='')}/join-token", {"ttl_s": 900})
    paths = (f'[paths]\nconfig_dir = "{layout.config_dir}"\n'
             f'state_dir = "{layout.state_dir}"\n')  # fmt: skip
    cfg, dirs = q(layout.config), f"{q(layout.config_dir)} {q(layout.state_dir)}"
    remote.run(f"mkdir -p {dirs} && test -e {cfg} || cat > {cfg}", "writing the config",
               data=paths.encode())  # fmt: skip
    agentd = f"{q(layout.venv)}/bin/llmgw-agentd --config {q(layout.config)}"
    remote.run(f"{agentd} join {q(t['url'])} {q(t['token'])} --ca-sha256 {q(t['ca_sha256'])}",
               "joining")  # fmt: skip
    # join wrote [agent] last: these lines belong to it.
    extra = [f'host = "{remote.host}"', *agent_set]
    remote.run(f"cat >> {q(layout.config)}", "configuring the agent",
               data=("\n".join(extra) + "\n").encode())  # fmt: skip


def start(remote: Remote, layout: Layout, systemd: bool) -> str:
    """(Re)start the agent; what to tell the operator."""
    q = shlex.quote
    command = f"{layout.venv}/bin/llmgw-agentd --config {layout.config}"
    if systemd:
        unit = (
            "[Unit]\nDescription=llmgw agent\nAfter=network-online.target\n\n"
            f"[Service]\nExecStart={command}\nKillMode=process\nRestart=on-failure\n\n"
            "[Install]\nWantedBy=multi-user.target\n"
        )
        remote.run(f"cat > /etc/systemd/system/{UNIT} && systemctl daemon-reload &&"
                   f" systemctl enable --quiet {UNIT} && systemctl restart {UNIT}",
                   "starting the agent's unit", data=unit.encode())  # fmt: skip
        return f"started {UNIT}"
    pid = f"{layout.state_dir}/agentd.pid"
    log = f"{layout.state_dir}/agentd.log"
    # SIGTERM leaves engines running: an upgrade does not stop the models.
    remote.run(
        f"if test -f {q(pid)} && kill -0 $(cat {q(pid)}) 2>/dev/null; then kill $(cat {q(pid)});"
        f" while kill -0 $(cat {q(pid)}) 2>/dev/null; do sleep 0.1; done; fi;"
        f" nohup setsid {command} >> {q(log)} 2>&1 < /dev/null & echo $! > {q(pid)}",
        "starting the agent",
    )
    return (f"no systemd on {remote.host}: the agent runs detached (pid in {pid}); under a"
            f" supervisor, run: {command}")  # fmt: skip


def wait_hello(api: Admin, name: str, version: str, wait_s: float) -> dict:
    deadline = time.monotonic() + wait_s
    while True:
        node = next((n for n in api.get("/v1/nodes") if n["name"] == name), None)
        if node and node["state"] in ("up", "draining") and node.get("version") == version:
            return node
        if time.monotonic() > deadline:
            seen = f"it is {node['state']} at {node.get('version')}" if node else "never seen"
            raise OnboardError(f"{name} did not say hello with llmgw {version} within"
                               f" {wait_s:g}s ({seen}); see its agent's log")  # fmt: skip
        time.sleep(0.5)


def onboard(api: Admin, remote: Remote, layout: Layout, name: str, agent_set: tuple[str, ...],
            wait_s: float, say) -> dict:  # fmt: skip
    """Onboard (or upgrade) `name`; its node object. Raises OnboardError."""
    registered = any(p["name"] == name for p in api.get("/v1/peers", kind="agent"))
    release = newest_release(api)
    started = time.monotonic()
    systemd = check_host(remote, layout)
    say(f"{remote.host}: Python ok, systemd {'yes' if systemd else 'no'}")
    install(api, remote, layout, release)
    say(f"installed llmgw {release['version']} into {layout.venv}")
    try:
        if not registered:
            join(api, remote, layout, name, agent_set)
            say(f"joined as {name}")
        say(start(remote, layout, systemd))
        node = wait_hello(api, name, release["version"], wait_s)
    except click.ClickException:
        # Leave nothing half-registered: a new node that joined (even if ssh lost the
        # answer) is removed again, and its token has been used.
        if not registered and any(p["name"] == name for p in api.get("/v1/peers", kind="agent")):
            api.delete(f"/v1/peers/{quote(name, safe='')}?kind=agent&force=1")
            say(f"removed {name} again")
        raise
    api.post(f"/v1/nodes/{quote(name, safe='')}/access", {"access": access_of(remote, layout)})
    node["onboard_s"] = round(time.monotonic() - started, 1)
    node["upgraded"] = registered
    return node


def access_of(remote: Remote, layout: Layout) -> dict:
    """What `llmgw nodes upgrade` needs to reach the node again."""
    target = remote.user_host + (f":{remote.port}" if remote.port else "")
    return {"ssh": target, "identity": str(remote.identity) if remote.identity else None,
            "options": list(remote.options), "venv": layout.venv, "config": layout.config,
            "state_dir": layout.state_dir, "python": layout.python}  # fmt: skip


def from_access(access: dict) -> tuple[Remote, Layout]:
    identity = Path(access["identity"]) if access.get("identity") else None
    remote = Remote.parse(access["ssh"], identity, tuple(access.get("options") or ()))
    layout = Layout(access["venv"], access["config"], access["state_dir"], access["python"])
    return remote, layout


def upgrade(api: Admin, name: str, drain_wait_s: float, wait_s: float, say) -> dict:
    """Upgrade one onboarded node to the newest release: drain it while its models have
    somewhere to go (for at most `drain_wait_s`), install, restart, wait for its hello
    with the new version, undrain. Engines survive the agent's restart, so replicas that
    could not move keep serving through it."""
    release = newest_release(api)
    node = next((n for n in api.get("/v1/nodes") if n["name"] == name), None)
    if node is None:
        raise OnboardError(f"no node {name} (see `llmgw nodes`)")
    if node.get("version") == release["version"]:
        say(f"{name} runs llmgw {release['version']} already")
        return {**node, "upgraded": False}
    remote, layout = from_access(api.get(f"/v1/nodes/{quote(name, safe='')}/access")["access"])
    path = quote(name, safe="")
    mine = [r["id"] for r in api.get("/v1/replicas") if r["node"] == name]
    drained = bool(mine) and node["state"] != "draining"
    if drained:
        api.post(f"/v1/nodes/{path}/drain")
        say(f"draining {name}: {len(mine)} replica(s)")
    try:
        deadline = time.monotonic() + drain_wait_s
        while mine and time.monotonic() < deadline:
            time.sleep(0.5)
            mine = [r["id"] for r in api.get("/v1/replicas") if r["node"] == name]
        if mine:
            say(f"{len(mine)} replica(s) have nowhere else to go: upgrading under them"
                " (engines keep running)")  # fmt: skip
        out = onboard(api, remote, layout, name, (), wait_s, say)
    finally:
        if drained:
            api.post(f"/v1/nodes/{path}/undrain")
    return out
