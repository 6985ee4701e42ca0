"""`llmgw nodes` and `llmgw routers`: who may join the bus, and (nodes) what each reports."""

import os
import time
from pathlib import Path
from urllib.parse import quote

import click

from llmgw import apikeys, audit, peers
from llmgw_ctl import onboard
from llmgw_ctl.api import actor, client
from llmgw_ctl.common import pass_state, print_json, print_table, when
from llmgw_ctl.gpus import gpu_rows, print_gpus
from llmgw_ctl.status import print_nodes


def _add(state, name: str, kind: str, as_json: bool, direct: bool, out: Path | None) -> None:
    if direct:
        keys_dir = state.cfg.curve_dir()
        state.store()
        try:
            peer = peers.peer_json(peers.register(keys_dir, name, kind))
        except peers.PeerError as e:
            raise click.ClickException(str(e)) from None
        audit.record(f"{'nodes' if kind == 'agent' else 'routers'}.add", actor(), "local", name)
        peer["key_dir"] = str(keys_dir)
        if out is not None:
            peer["files"] = peers.key_files(keys_dir, name)
    else:
        body = {"name": name, "kind": kind, "files": out is not None}
        peer = client(state).post("/v1/peers", body)
    files = peer.pop("files", None)
    if out is not None:
        _write_keys(out, files or {})
    if as_json:
        print_json(peer)
        return
    where = out or Path(peer["key_dir"])
    host = "here" if out is not None or direct else "on the scheduler's host"
    click.echo(f"{name}: registered; its keypair is {where / (name + '.key_secret')} ({host})",
               err=True)  # fmt: skip
    # The node's own directory: this machine's config says nothing about the node's.
    click.echo(
        f"copy that file and {where / 'scheduler.key'} into the {kind}'s"
        " <config_dir>/pki/curve/ (/etc/llmgw/pki/curve/ by default), owned by llmgw,"
        " mode 0600",
        err=True,
    )


def _drain_first(state, name: str, wait_s: float, quiet: bool) -> None:
    """Drain NAME and wait until none of its replicas is left (each is stopped once its
    model has enough ready replicas elsewhere, or after scheduler.drain_grace_s)."""
    api = client(state)

    def mine() -> list[str]:
        return [r["id"] for r in api.get("/v1/replicas") if r["node"] == name]

    if not any(p["name"] == name for p in api.get("/v1/peers", kind="agent")):
        return  # not registered: the removal says so
    left = mine()
    if not left:
        return
    api.post(f"/v1/nodes/{quote(name, safe='')}/drain")
    if not quiet:
        click.echo(f"draining {name}: waiting for its {len(left)} replica(s) to stop", err=True)
    deadline = time.monotonic() + wait_s
    while left:
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"{name} still has {len(left)} replica(s) after {wait_s:g}s of draining"
                f" ({', '.join(left[:5])}): wait longer (--wait), or --force to cut it off"
            )
        time.sleep(0.5)
        left = mine()


def _remove(state, name: str, kind: str, force: bool, direct: bool, as_json: bool,
            wait_s: float = 0.0) -> None:  # fmt: skip
    """Delete the peer and revoke its key: the bus refuses it from its next handshake,
    and (on the scheduler that handled it) its messages from now on."""
    group = "nodes" if kind == "agent" else "routers"
    if direct:
        state.store()
        if kind == "agent" and not force:
            # Only the schedulers know what a node runs (its agent reports it to them).
            raise click.ClickException(
                "with --store no scheduler says whether the node still has replicas:"
                " drain it first and pass --force too, or remove it through the scheduler"
            )
        try:
            removed = peers.remove(state.cfg.curve_dir(), name, kind)
        except peers.PeerError as e:
            raise click.ClickException(str(e)) from None
        peer = peers.peer_json(removed)
        audit.record(f"{group}.remove", actor(), "local", name, **peers.removal_detail(removed))
    else:
        if kind == "agent" and not force:
            _drain_first(state, name, wait_s, as_json)
        query = f"?kind={kind}" + ("&force=1" if force else "")
        peer = client(state).delete(f"/v1/peers/{quote(name, safe='')}{query}")
    if as_json:
        print_json(peer)
        return
    click.echo(f"{name}: removed; its key is refused from now on", err=True)


def remove_options(f):
    f = click.option(
        "--store", "direct", is_flag=True, help="Remove from the store directly, not through"
        " the scheduler (the schedulers refuse the key within 2 s)."
    )(f)  # fmt: skip
    f = click.option("--json", "as_json", is_flag=True, help="Print the removed peer as JSON.")(f)
    return click.argument("name")(f)


def _write_keys(out: Path, files: dict[str, str]) -> None:
    """Write the peer's keypair and the scheduler's public key, 0600, each whole."""
    try:
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, text in files.items():
            tmp = out / (name + ".part")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            tmp.rename(out / name)
    except OSError as e:
        raise click.ClickException(f"cannot write the keys to {out}: {e.strerror or e}") from None


def _list(state, kind: str, as_json: bool) -> None:
    peers_ = client(state).get("/v1/peers", kind=kind)
    if as_json:
        print_json(peers_)
        return
    print_table(
        ["NAME", "PUBLIC KEY", "ADDED"],
        [[p["name"], p["public_key"], when(p["created_at"])] for p in peers_],
    )


def add_options(f):
    """NAME, --json, --out and --store: the same for `nodes add` and `routers add`."""
    f = click.option(
        "--store",
        "direct",
        is_flag=True,
        help="Register in the store directly, not through the scheduler.",
    )(f)
    f = click.option(
        "--out",
        type=click.Path(file_okay=False, path_type=Path),
        help="Also write its keypair and the scheduler's public key here.",
    )(f)
    f = click.option("--json", "as_json", is_flag=True, help="Print the peer as JSON.")(f)
    return click.argument("name")(f)  # fmt: skip


GPUS_HELP = "One row per GPU: its memory, health and the replica assigned it."


@click.group("nodes", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--gpus", "gpus", is_flag=True, help=GPUS_HELP)
@click.pass_context
def nodes(ctx, as_json, gpus):
    """Nodes: who may join the bus, and what each reports (the default command is `list`).

    \b
    Examples:
      llmgw nodes add gpu-01
      llmgw nodes
      llmgw nodes --gpus
      llmgw nodes list --json | jq -r '.[] | select(.state!="up") | .name'
      llmgw nodes --gpus --json | jq -r '.[] | select(.replica==null) | .uuid'
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(nodes_list, as_json=as_json, gpus=gpus)


@nodes.command("add")
@add_options
@pass_state
def nodes_add(state, name, as_json, out, direct):
    """Make NAME's CURVE keypair and let its agent in."""
    _add(state, name, "agent", as_json, direct, out)


@nodes.command("join-token")
@click.argument("name")
@click.option("--ttl", default="1h", show_default=True, help="How long it works: 30m, 1h, 2d.")
@click.option("--json", "as_json", is_flag=True, help="Print the token and its command as JSON.")
@pass_state
def nodes_join_token(state, name, ttl, as_json):
    """A one-time token for node NAME to join with, and the command to run on it.

    The token works once and expires; making and using it are in the audit log. It
    needs the admin API on HTTPS with a certificate from the cluster CA: the node
    checks that CA against the fingerprint printed here before it sends the token.

    \b
    Examples:
      llmgw nodes join-token gpu-07 --ttl 30m
      # then on gpu-07:
      llmgw-agentd join https://cp1:8081 llmgw-join-… --ca-sha256 3f9a…
    """
    try:
        ttl_s = apikeys.parse_duration(ttl)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--ttl") from None
    out = client(state).post(f"/v1/nodes/{quote(name, safe='')}/join-token", {"ttl_s": ttl_s})
    if as_json:
        return print_json(out)
    click.echo(out["command"])
    click.echo(f"works once, until {when(out['expires_at'])}", err=True)


@nodes.command("onboard")
@click.argument("name")
@click.option(
    "--ssh",
    "target",
    required=True,
    metavar="[USER@]HOST[:PORT]",
    help="Where to install, with the system's ssh (BatchMode: no prompts).",
)
@click.option(
    "--identity",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The ssh private key to use.",
)
@click.option(
    "-o",
    "ssh_options",
    multiple=True,
    metavar="OPTION",
    help="An ssh -o option, e.g. UserKnownHostsFile=FILE (repeatable).",
)
@click.option(
    "--venv",
    default="/opt/llmgw/venv",
    show_default=True,
    help="The virtual environment on the node.",
)
@click.option(
    "--node-config",
    default="/etc/llmgw/llmgw.toml",
    show_default=True,
    help="The node's config file.",
)
@click.option(
    "--state-dir", default="/var/lib/llmgw", show_default=True, help="The node's paths.state_dir."
)
@click.option(
    "--python", default="python3", show_default=True, help="The node's Python (3.11 or newer)."
)
@click.option(
    "--set",
    "agent_set",
    multiple=True,
    metavar="KEY=VALUE",
    help="An [agent] key for a new node, as TOML (repeatable): --set 'port_min=9100'.",
)
@click.option(
    "--wait",
    "wait_s",
    default=120.0,
    show_default=True,
    help="Seconds to wait for the node's hello.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the node as JSON.")
@pass_state
def nodes_onboard(state, name, target, identity, ssh_options, venv, node_config, state_dir,
                  python, agent_set, wait_s, as_json):  # fmt: skip
    """Make HOST node NAME over SSH: install the newest release (`llmgw release list`)
    into a venv there, join with a one-time token, start the agent (a systemd unit where
    systemd runs) and wait for its hello. On a failure nothing stays registered.

    Onboarding a registered node again upgrades it to the newest release: one node,
    its engines left running across the agent's restart.

    Needs ssh access as a user who may write the paths (root for the defaults) and
    the admin API on HTTPS with the cluster CA (as join tokens do).

    \b
    Examples:
      llmgw nodes onboard gpu-07 --ssh root@10.0.0.7
      llmgw nodes onboard gpu-08 --ssh admin@gpu-08:2222 --identity ~/.ssh/fleet
    """
    remote = onboard.Remote.parse(target, identity, ssh_options)
    layout = onboard.Layout(venv, node_config, state_dir, python)
    say = (lambda text: None) if as_json else (lambda text: click.echo(text, err=True))
    node = onboard.onboard(client(state), remote, layout, name, agent_set, wait_s, say)
    if as_json:
        return print_json(node)
    verb = "upgraded" if node["upgraded"] else "onboarded"
    click.echo(f"{verb}: {name} runs llmgw {node['version']} ({node['onboard_s']}s)", err=True)


@nodes.command("upgrade")
@click.argument("name", required=False)
@click.option("--all", "all_", is_flag=True, help="Every node onboarded with `nodes onboard`.")
@click.option(
    "--drain-wait",
    "drain_wait_s",
    default=300.0,
    show_default=True,
    help="Seconds to let a node's replicas move elsewhere before upgrading it.",
)
@click.option(
    "--wait",
    "wait_s",
    default=120.0,
    show_default=True,
    help="Seconds to wait for each node's hello with the new release.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the nodes as JSON.")
@pass_state
def nodes_upgrade(state, name, all_, drain_wait_s, wait_s, as_json):
    """Upgrade NAME (or --all, one node at a time) to the newest release, reaching each
    the way `llmgw nodes onboard` did: drain it while its models have somewhere to go,
    install the release, restart the agent (engines keep running), wait for its hello
    with the new version, undrain. Stops at the first node that fails.

    \b
    Examples:
      llmgw release publish dist/llmgw-0.2.1rc1-py3-none-any.whl
      llmgw nodes upgrade gpu-07
      llmgw nodes upgrade --all
    """
    if bool(name) == all_:
        raise click.UsageError("name a NODE, or pass --all")
    api = client(state)
    names = [name] if name else [p["name"] for p in api.get("/v1/peers", kind="agent")]
    say = (lambda text: None) if as_json else (lambda text: click.echo(text, err=True))
    done = []
    for n in names:
        if all_:
            try:
                api.get(f"/v1/nodes/{quote(n, safe='')}/access")
            except click.ClickException:
                say(f"{n}: not onboarded with `llmgw nodes onboard`, skipped")
                continue
        node = onboard.upgrade(api, n, drain_wait_s, wait_s, say)
        done.append(node)
        if node.get("upgraded"):
            say(f"upgraded: {n} runs llmgw {node['version']}")
    if as_json:
        print_json(done)


@nodes.command("remove")
@remove_options
@click.option("--force", is_flag=True, help="At once, with its replicas (they are cut off).")
@click.option(
    "--wait",
    "wait_s",
    default=900.0,
    show_default=True,
    help="Seconds to wait for its replicas to drain away.",
)
@pass_state
def nodes_remove(state, name, as_json, direct, force, wait_s):
    """Drain NAME, then forget it and revoke its CURVE key: its agent is refused from
    now on.

    Draining stops each of its replicas once its model has enough ready replicas
    elsewhere (or after scheduler.drain_grace_s); --force cuts the node off at once.

    \b
    Examples:
      llmgw nodes remove gpu-01
      llmgw nodes remove gpu-01 --force
    """
    _remove(state, name, "agent", force, direct, as_json, wait_s)


@nodes.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--gpus", "gpus", is_flag=True, help=GPUS_HELP)
@pass_state
def nodes_list(state, as_json, gpus):
    """Every node as the scheduler sees it now: registered ones that never reported
    included ("never seen"), with memory, GPUs, replicas and engines (what each build
    can use; a failed install with its reason and when the agent retries it).

    With --gpus, each GPU instead: node, index, UUID, name, memory used of total, health
    (an unhealthy or MIG-mode card takes no replica) and the replica assigned it, as
    MODEL/REPLICA. A lost node's GPUs are not shown: what it last reported no longer holds.
    """
    body = client(state).get("/v1/nodes")
    if gpus:
        rows = gpu_rows(body)
        return print_json(rows) if as_json else print_gpus(rows)
    if as_json:
        print_json(body)
        return
    print_nodes(body, time.time())


@click.group("routers", invoke_without_command=True)
@click.pass_context
def routers(ctx):
    """Routers that may receive the routing table (the default command is `list`)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(routers_list)


@routers.command("add")
@add_options
@pass_state
def routers_add(state, name, as_json, out, direct):
    """Make NAME's CURVE keypair and let the router subscribe."""
    _add(state, name, "router", as_json, direct, out)


@routers.command("remove")
@remove_options
@pass_state
def routers_remove(state, name, as_json, direct):
    """Forget NAME and revoke its CURVE key: the router is refused from its next
    connection on (restart it to cut it off now).

    \b
    Examples:
      llmgw routers remove edge-01
    """
    _remove(state, name, "router", True, direct, as_json)


@routers.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_state
def routers_list(state, as_json):
    """Registered routers."""
    _list(state, "router", as_json)
