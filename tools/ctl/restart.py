"""`llmgw restart`: replace replicas one by one, without an outage."""

import sys
import time

import click

from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table

ENDED = ("done", "given up")


@click.command("restart")
@click.argument("replica_ids", nargs=-1, metavar="[REPLICA]...")
@click.option("--model", help="Restart every replica of this model.")
@click.option("--all", "every", is_flag=True, help="Restart every replica of every model.")
@click.option(
    "--max-surge",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Replacements of one model started beside their old replicas at once.",
)
@click.option(
    "--max-unavailable",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Replicas of one model stopped before their replacement is ready; with "
    "--max-surge 0, up to this many are stopped first, then their replacements started.",
)
@click.option(
    "--in-place",
    is_flag=True,
    help="Stop each replica first, then start its successor (no extra memory).",
)
@click.option("--wait", is_flag=True, help="Wait until every restart is done or given up.")
@click.option(
    "--timeout",
    type=click.IntRange(min=1),
    default=900,
    show_default=True,
    metavar="SECONDS",
    help="How long --wait waits.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the restarts as a JSON array.")
@pass_state
def restart(state, replica_ids, model, every, max_surge, max_unavailable, in_place, wait,
            timeout, as_json):  # fmt: skip
    """Restart replicas: each keeps serving while its replacement starts beside it.

    Replicas of one model go one at a time unless --max-surge / --max-unavailable
    allow more. Where only the old replica is in the way, it is stopped first and
    replaced in place; where nothing would fit even then, its restart is given up
    and the reason said. The restarts are queued: `llmgw replicas` shows
    "(restart queued)" and "(restart replacing)"; one that waits
    scheduler.restart_deadline_s without its model's restarts moving is given up.
    --wait follows them to the end and exits 1 if any was given up.

    \b
    Examples:
      llmgw restart r-1a2b3c4d
      llmgw restart --model gemma3-270m --wait
      llmgw restart --all --max-surge 2
      llmgw replicas --json | jq -r '.[] | select(.stale) | .id' | xargs llmgw restart
    """
    if sum(bool(x) for x in (replica_ids, model, every)) != 1:
        raise click.UsageError("name replicas, or give --model M, or --all (one of them)")
    if in_place and max_unavailable == 0:
        raise click.UsageError("--in-place needs --max-unavailable of 1 or more")
    body = {"max_surge": max_surge, "max_unavailable": max_unavailable, "in_place": in_place}
    if replica_ids:
        body["replicas"] = list(replica_ids)
    elif model:
        body["model"] = model
    else:
        body["all"] = True
    api = client(state)
    queued = api.post("/v1/restarts", body)["queued"]
    if not queued:
        click.echo("nothing to restart: no running replicas", err=True)
        return
    if wait:
        queued = _wait(api, {j["replica"] for j in queued}, timeout)
    if as_json:
        print_json(queued)
    else:
        print_restarts(queued)
    if not wait:
        click.echo("queued: follow them with `llmgw replicas` (or use --wait)", err=True)
    if wait and any(j["state"] == "given up" for j in queued):
        raise SystemExit(1)


def _wait(api, ids: set[str], timeout: float) -> list[dict]:
    """Poll until every restart of `ids` has ended; a line of progress on a terminal."""
    deadline = time.monotonic() + timeout
    tty = sys.stderr.isatty()
    while True:
        mine = {}
        for j in api.get("/v1/restarts"):
            if j["replica"] in ids:
                mine[j["replica"]] = j  # the newest restart of each replica comes last
        ended = sum(1 for j in mine.values() if j["state"] in ENDED)
        if tty:
            click.echo(f"\r{ended}/{len(ids)} restarted", nl=False, err=True)
        if ended == len(ids):
            if tty:
                click.echo(err=True)
            return list(mine.values())
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"{len(ids) - ended} of {len(ids)} restarts still under way after {timeout}s"
                " (they go on: follow them with `llmgw replicas`)"
            )
        time.sleep(1.0)


def print_restarts(jobs: list[dict]) -> None:
    print_table(
        ["REPLICA", "MODEL", "NODE", "RESTART", "HOW", "REPLACEMENT", "REASON"],
        [
            [j["replica"], j["model"], j["node"], j["state"], j.get("how") or "-",
             j.get("replacement") or "-", j.get("reason") or ""]
            for j in jobs
        ],
    )  # fmt: skip
