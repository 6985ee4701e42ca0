"""`llmgw logs`: the tail of an engine's output, from the agent that runs it."""

from urllib.parse import quote

import click

from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json


@click.command("logs")
@click.argument("node")
@click.option("--shard", "shard", required=True, help="The replica id (see `llmgw replicas`).")
@click.option("--lines", type=click.IntRange(1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print {node, id, lines}.")
@pass_state
def logs(state, node, shard, lines, as_json):
    """Print the last lines an engine wrote (the agent keeps agent.log_lines of them).

    \b
    Examples:
      llmgw logs gpu-01 --shard r-3f2a9c01
      llmgw replicas --model gemma3-270m --json | jq -r '.[] | "\\(.node) \\(.id)"' |
          while read node id; do llmgw logs "$node" --shard "$id" --lines 5; done
    """
    path = f"/v1/nodes/{quote(node, safe='')}/shards/{quote(shard, safe='')}/logs"
    body = client(state).get(path, lines=lines)
    if as_json:
        print_json(body)
        return
    for line in body.get("lines", []):
        click.echo(line)
