"""`llmgw nodes` and `llmgw routers`: who may join the bus, and (nodes) what each reports."""

import time

import click

from llmgw import bus
from llmgw.store import BusPeer
from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table, when
from llmgw_ctl.status import print_nodes


def peer_json(p: BusPeer) -> dict:
    return {"name": p.name, "kind": p.kind, "public_key": p.public_key, "created_at": p.created_at}


def _add(state, name: str, kind: str, as_json: bool) -> None:
    if not name or "/" in name or name == bus.SCHEDULER:
        raise click.BadParameter(f"{name!r} cannot be a name", param_hint="NAME")
    keys_dir = state.cfg.curve_dir()
    state.store()
    try:
        bus.create_keypair(keys_dir, bus.SCHEDULER)  # agents and routers need its public key
        public = bus.create_keypair(keys_dir, name)
    except (OSError, bus.BusError) as e:
        raise click.ClickException(f"cannot write keys under {keys_dir}: {e}") from None
    existing = BusPeer.get_or_none(BusPeer.name == name)
    if existing is not None and existing.public_key != public:
        raise click.ClickException(
            f"{name} is registered with another key; remove it first (or use another name)"
        )
    if existing is None:
        BusPeer.create(name=name, kind=kind, public_key=public, created_at=time.time())
    peer = BusPeer.get(BusPeer.name == name)
    if as_json:
        print_json(peer_json(peer))
        return
    click.echo(f"{name}: registered; its keypair is {keys_dir / (name + '.key_secret')}", err=True)
    click.echo(
        f"copy that file and {keys_dir / 'scheduler.key'} to the {kind}'s {keys_dir}/", err=True
    )


def _list(state, kind: str, as_json: bool) -> None:
    state.store()
    peers = list(BusPeer.select().where(BusPeer.kind == kind).order_by(BusPeer.name))
    if as_json:
        print_json([peer_json(p) for p in peers])
        return
    print_table(
        ["NAME", "PUBLIC KEY", "ADDED"], [[p.name, p.public_key, when(p.created_at)] for p in peers]
    )


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
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@pass_state
def nodes_add(state, name, as_json):
    """Make NAME's CURVE keypair and let its agent in."""
    _add(state, name, "agent", as_json)


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
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@pass_state
def routers_add(state, name, as_json):
    """Make NAME's CURVE keypair and let the router subscribe."""
    _add(state, name, "router", as_json)


@routers.command("list")
@click.option("--json", "as_json", is_flag=True)
@pass_state
def routers_list(state, as_json):
    """Registered routers."""
    _list(state, "router", as_json)
