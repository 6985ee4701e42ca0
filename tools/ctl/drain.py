"""`llmgw drain` / `llmgw undrain`: empty a node of replicas without an outage."""

from urllib.parse import quote

import click

from llmgw_ctl.api import client
from llmgw_ctl.common import json_option, pass_state, queued


def _node_path(name: str, action: str) -> str:
    return f"/v1/nodes/{quote(name, safe='')}/{action}"


@click.command("drain")
@click.argument("node")
@json_option
@pass_state
def drain(state, node, as_json):
    """Move every replica off NODE and place nothing new there.

    Each replica there keeps serving until its model has enough ready replicas on
    other nodes (or scheduler.drain_grace_s passes), then it is stopped. The change is
    queued: watch it with `llmgw replicas`.

    \b
    Examples:
      llmgw drain gpu-03
      llmgw replicas --json | jq -r '.[] | select(.node=="gpu-03") | .id'
    """
    body = client(state).post(_node_path(node, "drain"))
    queued(body, as_json, f"drain {body.get('node', node)}")


@click.command("undrain")
@click.argument("node")
@json_option
@pass_state
def undrain(state, node, as_json):
    """Let the scheduler place replicas on NODE again.

    \b
    Example:
      llmgw undrain gpu-03
    """
    body = client(state).post(_node_path(node, "undrain"))
    queued(body, as_json, f"undrain {body.get('node', node)}")
