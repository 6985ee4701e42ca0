"""`llmgw usage`: who used what, from the routers' usage rows and their daily rollups."""

import csv
import datetime
import sys
import time

import click

from llmgw import apikeys, audit
from llmgw import usage as usagelib
from llmgw_ctl.api import actor, client
from llmgw_ctl.common import pass_state, print_json, print_table
from llmgw_ctl.tenancy import store_option

COLUMNS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cost")


@click.group("usage", invoke_without_command=True)
@click.option("--by", type=click.Choice(usagelib.BY), default="key", show_default=True,
              help="Group by this (model: the model that answered).")  # fmt: skip
@click.option("--since", metavar="AGE", default="7d", show_default=True,
              help="How far back, e.g. 24h, 7d, 4w.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV with a header line.")
@store_option
@click.pass_context
def usage(ctx, by, since, as_json, as_csv, direct):
    """Requests, tokens and cost per key, user, project, team, org or model.

    Days the daily rollup has already summed count whole: a report reaching back past
    the last rollup starts at the beginning of that day.

    \b
    Examples:
      llmgw usage --by org --since 30d
      llmgw usage --by model --since 24h --json | jq '.[] | {model, cost}'
      llmgw usage --by user --csv > usage.csv
      llmgw usage rollup          # daily, from llmgw-usage-rollup.timer
    """
    if ctx.invoked_subcommand is not None:
        return
    state = ctx.obj
    try:
        after = time.time() - apikeys.parse_duration(since)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None
    if direct:
        state.store()
        rows = usagelib.report(by, after, time.time())
    else:
        rows = client(state).get("/v1/usage", by=by, since=after)
    if as_json:
        print_json(rows)
    elif as_csv:
        out = csv.writer(sys.stdout, lineterminator="\n")
        out.writerow([by, *COLUMNS])
        for r in rows:
            out.writerow([r[by], *(r[c] for c in COLUMNS)])
    else:
        print_table(
            [by.upper(), "REQUESTS", "ERRORS", "PROMPT", "COMPLETION", "COST"],
            [[r[by] or "-", f"{r['requests']:,}", f"{r['errors']:,}", f"{r['prompt_tokens']:,}",
              f"{r['completion_tokens']:,}", f"{r['cost']:,.4f}"] for r in rows],
        )  # fmt: skip


@usage.command("rollup")
@click.option(
    "--retention-days",
    type=click.IntRange(0),
    metavar="DAYS",
    help="Keep raw rows this many days (default usage.retention_days; 0: all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
@store_option
@pass_state
def usage_rollup(state, retention_days, as_json, direct):
    """Sum complete days into daily totals and prune raw rows past the retention.

    Safe to run at any time and as often as wanted: a day is summed once, and rows
    that arrive for it later are added by the next run.
    """
    days = state.cfg.usage.retention_days if retention_days is None else retention_days
    if direct:
        state.store()
        out = usagelib.rollup(time.time(), days)
        audit.record("usage.rollup", actor(), "local", "", retention_days=days, **out)
    else:
        out = client(state).post("/v1/usage/rollup", {"retention_days": days})
    if as_json:
        print_json(out)
    else:
        click.echo(
            f"rolled up {out['days_rolled_up']} day(s) into {out['rollup_rows']} row(s);"
            f" pruned {out['raw_rows_pruned']} raw row(s) and"
            f" {out.get('responses_pruned', 0)} stored response(s) older than {days} days",
            err=True,
        )


def _since(text: str, now: float) -> float:
    """--since: an age (30m, 24h, 7d), a Unix time, or a local ISO 8601 time."""
    try:
        return now - apikeys.parse_duration(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is neither an age (30m, 24h, 7d) nor a time (2025-06-01T09:00)",
            param_hint="--since",
        ) from None


def _percent(ratio: float | None, threshold: float) -> str:
    if ratio is None:
        return "-"
    mark = " !" if abs(ratio) > threshold else ""
    return f"{ratio * 100:+.2f}%{mark}"


@usage.command("reconcile")
@click.option(
    "--since",
    metavar="AGE|TIME",
    default="1h",
    show_default=True,
    help="From this long ago (30m, 24h) or this time (2025-06-01T09:00).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@pass_state
def usage_reconcile(state, since, as_json):
    """The usage rows of each replica against its engine's own token counters.

    Per replica, over the window between two of its engine's readings from --since to
    usage.reconcile_settle_s ago: prompt and completion tokens the routers' usage rows
    bill to it (ROWS), what the engine counted (ENGINE), and the difference as a part
    of the engine's count (below 0: the engine did work no row bills; `!` past
    usage.reconcile_threshold). docs/limits.md says how cached prompts, streams cut
    short and retried attempts count on each side.

    \b
    Examples:
      llmgw usage reconcile --since 24h
      llmgw usage reconcile --since 2025-06-01T09:00 --json | jq '.replicas[].ratio'
    """
    now = time.time()
    after = _since(since, now)
    out = client(state).get("/v1/usage/reconcile", since=after)
    if as_json:
        print_json(out)
        return
    threshold = out.get("threshold", 0.01)
    rows = []
    for r in out["replicas"]:
        router, engine, ratio = r["router"], r["engine"], r["ratio"]
        rows.append(
            [
                r["replica"],
                r["model"] or "-",
                f"{(r['to'] - r['from']) / 60:.0f}m",
                f"{router['requests'] or 0:,}",
                f"{router['prompt']:,}",
                f"{engine['prompt']:,}",
                _percent(ratio["prompt"], threshold),
                f"{router['completion']:,}",
                f"{engine['completion']:,}",
                _percent(ratio["completion"], threshold),
            ]
        )
    if not rows:
        click.echo("no replica has engine counters in that window", err=True)
        return
    print_table(
        [
            "REPLICA",
            "MODEL",
            "WINDOW",
            "REQUESTS",
            "PROMPT ROWS",
            "ENGINE",
            "DIFF",
            "COMPLETION ROWS",
            "ENGINE",
            "DIFF",
        ],
        rows,
    )
