"""`llmgw limits` and `llmgw budgets`: what a key, user, project, team or org may use.

Every router reads them from the store within `router.limits_refresh_s`; how they are
counted across routers is in docs/limits.md.
"""

import time

import click

from llmgw import audit, tenancy
from llmgw_ctl.api import actor, client
from llmgw_ctl.common import pass_state, print_json, print_table, when
from llmgw_ctl.tenancy import budget_text, direct_call, json_option, store_option


def subject_options(f):
    """--key K | --user U | --project P | --team T | --org O: exactly one."""
    for scope in reversed(("key", "user", "project", "team", "org")):
        f = click.option(f"--{scope}", f"{scope}_", metavar=scope.upper(),
                         help=f"The {scope} (an id for a key, else a name).")(f)  # fmt: skip
    return f


def subject(kw: dict) -> tuple[str, str]:
    given = [(s, kw[f"{s}_"]) for s in ("key", "user", "project", "team", "org") if kw[f"{s}_"]]
    if len(given) != 1:
        raise click.UsageError("say whose: one of --key, --user, --project, --team or --org")
    return given[0]


# -- limits ---------------------------------------------------------------------------


@click.group("limits", invoke_without_command=True)
@click.pass_context
def limits(ctx):
    """Requests per minute, tokens per minute and concurrent requests (default: `list`).

    A request must fit every limit of its key, user, project, their teams and org, so
    the tightest wins. Over a limit it is answered 429 with Retry-After.

    \b
    Examples:
      llmgw limits set --user ada@acme.org --rpm 60 --tpm 100000
      llmgw limits set --key key_1a2b3c4d5e6f --concurrent 4
      llmgw limits remove --user ada@acme.org --tpm
      llmgw limits list --json
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(limits_list)


@limits.command("set")
@subject_options
@click.option("--rpm", type=click.IntRange(0), help="Requests per minute.")
@click.option("--tpm", type=click.IntRange(0), help="Tokens (prompt + completion) per minute.")
@click.option("--concurrent", type=click.IntRange(0), help="Requests in flight at once.")
@json_option
@store_option
@pass_state
def limits_set(state, rpm, tpm, concurrent, as_json, direct, **kw):
    """Set limits; kinds not given keep their value."""
    scope, name = subject(kw)
    values = {"rpm": rpm, "tpm": tpm, "concurrent": concurrent}
    if direct:
        out = direct_call(state, tenancy.set_limits, scope, name, time.time(), **values)
        audit.record("limits.set", actor(), "local", f"{scope}:{name}", **values)
    else:
        out = client(state).post("/v1/limits", {"scope": scope, "subject": name, **values})
    if as_json:
        print_json(out)
    else:
        click.echo(f"{scope} {name}: {limit_text(out)}", err=True)


@limits.command("remove")
@subject_options
@click.option("--rpm", is_flag=True, help="Only the requests-per-minute limit.")
@click.option("--tpm", is_flag=True, help="Only the tokens-per-minute limit.")
@click.option("--concurrent", is_flag=True, help="Only the concurrency limit.")
@store_option
@pass_state
def limits_remove(state, rpm, tpm, concurrent, direct, **kw):
    """Remove limits (all of the subject's, unless some kinds are named)."""
    scope, name = subject(kw)
    kinds = [k for k, on in (("rpm", rpm), ("tpm", tpm), ("concurrent", concurrent)) if on]
    if direct:
        direct_call(state, tenancy.remove_limits, scope, name, time.time(), kinds)
        audit.record("limits.remove", actor(), "local", f"{scope}:{name}", kinds=kinds or None)
    else:
        body = {"scope": scope, "subject": name, "kinds": kinds}
        client(state).post("/v1/limits/remove", body)
    click.echo(f"{scope} {name}: removed {', '.join(kinds) or 'all limits'}", err=True)


@limits.command("list")
@click.option("--scope", type=click.Choice(tenancy.SCOPES), help="Only limits on these.")
@json_option
@store_option
@pass_state
def limits_list(state, scope=None, as_json=False, direct=False):
    """List every limit."""
    if direct:
        rows = direct_call(state, tenancy.limits, scope)
    else:
        rows = client(state).get("/v1/limits", scope=scope)
    if as_json:
        print_json(rows)
        return
    dash = lambda v: "-" if v is None else f"{v:,}"  # noqa: E731
    print_table(
        ["SCOPE", "SUBJECT", "RPM", "TPM", "CONCURRENT", "UPDATED"],
        [[r["scope"], r["subject"], dash(r["rpm"]), dash(r["tpm"]), dash(r["concurrent"]),
          when(r["updated_at"])] for r in rows],
    )  # fmt: skip


def limit_text(out: dict | None) -> str:
    if not out:
        return "no limits"
    return ", ".join(f"{k} {out[k]:,}" for k in tenancy.LIMIT_KINDS if out[k] is not None)


# -- budgets --------------------------------------------------------------------------


@click.group("budgets", invoke_without_command=True)
@click.pass_context
def budgets(ctx):
    """What may be spent per UTC day or month, in tokens or in cost (default: `list`).

    Cost is counted at the served model's [models.pricing]. A request is admitted only
    if its reservation (estimated prompt + max_tokens) fits; once a budget is spent,
    requests get 429 insufficient_quota until the period ends.

    \b
    Examples:
      llmgw budgets set --org acme --period month --cost 500
      llmgw budgets set --project chatbot --period day --tokens 2000000
      llmgw budgets list --json | jq '.[] | {subject, used}'
      llmgw budgets remove --project chatbot --period day
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(budgets_list)


@budgets.command("set")
@subject_options
@click.option("--period", type=click.Choice(("day", "month")), required=True,
              help="The UTC day or month.")  # fmt: skip
@click.option("--tokens", type=click.IntRange(0), help="Tokens (prompt + completion).")
@click.option("--cost", type=click.FloatRange(0), help="Cost, at the models' prices.")
@json_option
@store_option
@pass_state
def budgets_set(state, period, tokens, cost, as_json, direct, **kw):
    """Set a budget; a unit not given keeps its value."""
    scope, name = subject(kw)
    if tokens is None and cost is None:
        raise click.UsageError("say how much: --tokens and/or --cost")
    if direct:
        now = time.time()
        out = direct_call(state, tenancy.set_budget, scope, name, period, now, tokens, cost)
        audit.record("budgets.set", actor(), "local", f"{scope}:{name}", period=period,
                     tokens=tokens, cost=cost)  # fmt: skip
    else:
        body = {"scope": scope, "subject": name, "period": period, "tokens": tokens, "cost": cost}
        out = client(state).post("/v1/budgets", body)
    if as_json:
        print_json(out)
    else:
        click.echo(f"{scope} {name}: per {period} {budget_text(out)}", err=True)


@budgets.command("remove")
@subject_options
@click.option("--period", type=click.Choice(("day", "month")), help="Only this one.")
@store_option
@pass_state
def budgets_remove(state, period, direct, **kw):
    """Remove a subject's budgets (every period, unless --period)."""
    scope, name = subject(kw)
    if direct:
        direct_call(state, tenancy.remove_budget, scope, name, time.time(), period)
        audit.record("budgets.remove", actor(), "local", f"{scope}:{name}", period=period)
    else:
        body = {"scope": scope, "subject": name, "period": period}
        client(state).post("/v1/budgets/remove", body)
    click.echo(f"{scope} {name}: removed budgets{f' per {period}' if period else ''}", err=True)


@budgets.command("list")
@click.option("--scope", type=click.Choice(tenancy.SCOPES), help="Only budgets on these.")
@json_option
@store_option
@pass_state
def budgets_list(state, scope=None, as_json=False, direct=False):
    """List budgets with what has been used (or leased by routers) this period."""
    if direct:
        rows = direct_call(state, tenancy.budgets, scope, None, time.time())
    else:
        rows = client(state).get("/v1/budgets", scope=scope)
    if as_json:
        print_json(rows)
        return
    print_table(
        ["SCOPE", "SUBJECT", "PERIOD", "USED/BUDGET", "RESETS"],
        [[r["scope"], r["subject"], r["period"], budget_text(r), when(r["period_end"])]
         for r in rows],
    )  # fmt: skip
