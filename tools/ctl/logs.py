"""`llmgw logs`: the tail of an engine's output, from the agent that runs it."""

from urllib.parse import quote

import click

from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json


@click.command("logs")
@click.argument("target", metavar="REPLICA | NODE")
@click.option("--shard", "shard", help="With NODE: the replica id, for one that has stopped.")
@click.option("--lines", type=click.IntRange(1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print {node, id, lines}.")
@pass_state
def logs(state, target, shard, lines, as_json):
    """Print the last lines an engine wrote (the agent keeps agent.log_lines of them).

    A replica id is unique: `llmgw logs REPLICA` finds its node. A replica that has
    stopped or failed is no longer listed; name its node then, with --shard.

    \b
    Examples:
      llmgw logs r-3f2a9c01
      llmgw logs gpu-01 --shard r-3f2a9c01          # one that failed and is gone
      llmgw replicas --model gemma3-270m --json | jq -r '.[].id' | xargs -n1 llmgw logs
    """
    api = client(state)
    if shard is None:
        shard = target
        found = [r for r in api.get("/v1/replicas") if r["id"] == shard]
        if not found:
            raise click.ClickException(
                f"no running replica '{shard}' (see `llmgw replicas`); for one that has"
                f" stopped, name its node: llmgw logs NODE --shard {shard}"
            )
        node = found[0]["node"]
    else:
        node = target
    path = f"/v1/nodes/{quote(node, safe='')}/shards/{quote(shard, safe='')}/logs"
    body = api.get(path, lines=lines)
    if as_json:
        print_json(body)
        return
    for line in body.get("lines", []):
        click.echo(line)
