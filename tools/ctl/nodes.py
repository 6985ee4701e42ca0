"""`llmgw nodes` and `llmgw routers`: who may join the bus, and (nodes) what each reports."""

import os
import time
from pathlib import Path

import click

from llmgw import audit, peers
from llmgw_ctl.api import actor, client
from llmgw_ctl.common import pass_state, print_json, print_table, when
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


@click.group("nodes", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.pass_context
def nodes(ctx, as_json):
    """Nodes: who may join the bus, and what each reports (the default command is `list`).

    \b
    Examples:
      llmgw nodes add gpu-01
      llmgw nodes
      llmgw nodes list --json | jq -r '.[] | select(.state!="up") | .name'
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(nodes_list, as_json=as_json)


@nodes.command("add")
@add_options
@pass_state
def nodes_add(state, name, as_json, out, direct):
    """Make NAME's CURVE keypair and let its agent in."""
    _add(state, name, "agent", as_json, direct, out)


@nodes.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def nodes_list(state, as_json):
    """Every node as the scheduler sees it now: registered ones that never reported
    included ("never seen"), with memory, GPUs and replicas."""
    body = client(state).get("/v1/nodes")
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


@routers.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_state
def routers_list(state, as_json):
    """Registered routers."""
    _list(state, "router", as_json)
