"""`llmgw audit`: who changed what, and when."""

import json
import time

import click

from llmgw import apikeys
from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table, when


@click.command("audit")
@click.option("--since", metavar="AGE", help="Only changes this recent, e.g. 90m, 24h, 7d.")
@click.option("--action", metavar="PREFIX", help="Only these actions, e.g. keys or restart.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="At most this many, the newest.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array, oldest first.")
@pass_state
def audit(state, since, action, limit, as_json):
    """Changes made through the admin API (and `--store`): when, who, from where, what.

    \b
    Examples:
      llmgw audit --since 24h
      llmgw audit --action keys --json | jq -r '.[] | "\\(.actor) \\(.action) \\(.target)"'
    """
    try:
        after = time.time() - apikeys.parse_duration(since) if since else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None
    rows = client(state).get("/v1/audit", limit=limit, since=after, action=action)
    if as_json:
        print_json(rows)
        return
    print_table(
        ["WHEN", "ACTOR", "CLIENT", "ACTION", "TARGET", "DETAIL"],
        [
            [when(r["at"]), r["actor"], r["client"], r["action"], r["target"] or "-",
             json.dumps(r["detail"], sort_keys=True) if r["detail"] else ""]
            for r in rows
        ],
    )  # fmt: skip
