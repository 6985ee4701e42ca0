"""`llmgw orgs|teams|projects|users`: who uses the fleet, through the admin API.

The four groups have one shape (create, list, show, remove), so one factory makes
them. `--store` changes the store directly, for the first steps of an install before
any scheduler runs; the change is still put in the audit log.
"""

import time
from urllib.parse import quote

import click

from llmgw import audit, tenancy
from llmgw.errors import TenancyError
from llmgw_ctl.api import actor, client
from llmgw_ctl.common import pass_state, print_json, print_table, when

store_option = click.option(
    "--store",
    "direct",
    is_flag=True,
    help="Change the store directly, not through the scheduler (needs the store's URL).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")

EXAMPLES = {
    "org": "llmgw orgs create acme\n  llmgw orgs show acme --json",
    "team": "llmgw teams create research --org acme\n  llmgw teams list --org acme",
    "project": "llmgw projects create chatbot --org acme --team research --band gold\n"
    "  llmgw projects band chatbot silver",
    "user": "llmgw users create ada@acme.org --org acme --team research\n"
    "  llmgw users list --json | jq -r '.[].name'",
}


def direct_call(state, fn, *args, **kw):
    """Run a tenancy function on the store; its errors become one-line messages."""
    state.store()
    try:
        return fn(*args, **kw)
    except TenancyError as e:
        raise click.ClickException(str(e)) from None


def bands_of(state) -> list[str]:
    return list(state.cfg.router.bands)


def make_group(kind: str) -> click.Group:
    plural = f"{kind}s"

    @click.group(plural, invoke_without_command=True)
    @click.pass_context
    def group(ctx):
        if ctx.invoked_subcommand is None:
            ctx.invoke(group_list)

    group.help = (
        f"{plural.capitalize()} that keys, limits, budgets and usage belong to (the default "
        f"command is `list`).\n\n\b\nExamples:\n  {EXAMPLES[kind]}"
    )

    @group.command("create")
    @click.argument("name")
    @click.option("--org", help="The org it belongs to (implied by --team).", hidden=kind == "org")
    @click.option("--team", help="A team of its org.", hidden=kind not in ("project", "user"))
    @click.option("--band", help="Priority band of its keys (router.bands).",
                  hidden=kind != "project")  # fmt: skip
    @json_option
    @store_option
    @pass_state
    def group_create(state, name, org, team, band, as_json, direct):
        body = {"name": name, "org": org, "team": team, "band": band}
        if direct:
            out = direct_call(state, tenancy.create, kind, name, time.time(), org=org, team=team,
                              band=band, bands=bands_of(state))  # fmt: skip
            audit.record(f"{plural}.create", actor(), "local", name, org=out.get("org"),
                         team=out.get("team"), band=out.get("band"))  # fmt: skip
        else:
            out = client(state).post(f"/v1/{plural}", body)
        if as_json:
            print_json(out)
        else:
            click.echo(f"created {kind} {out['name']}", err=True)

    group_create.help = f"Create a {kind}."

    @group.command("list")
    @click.option("--org", help="Only those of this org.", hidden=kind == "org")
    @json_option
    @store_option
    @pass_state
    def group_list(state, org=None, as_json=False, direct=False):
        if direct:
            rows = direct_call(state, tenancy.listing, kind, org)
        else:
            rows = client(state).get(f"/v1/{plural}", org=org)
        if as_json:
            print_json(rows)
            return
        headers = ["NAME"] + (["ORG"] if kind != "org" else [])
        headers += ["TEAM"] if kind in ("project", "user") else []
        headers += ["BAND"] if kind == "project" else []
        table = []
        for r in rows:
            line = [r["name"]] + ([r["org"]] if kind != "org" else [])
            line += [r["team"] or "-"] if kind in ("project", "user") else []
            line += [r["band"] or "-"] if kind == "project" else []
            table.append(line + [when(r["created_at"])])
        print_table(headers + ["CREATED"], table)

    group_list.help = f"List {plural}."

    @group.command("show")
    @click.argument("name")
    @json_option
    @store_option
    @pass_state
    def group_show(state, name, as_json, direct):
        if direct:
            out = direct_call(state, tenancy.show, kind, name, time.time())
        else:
            out = client(state).get(f"/v1/{plural}/{quote(name, safe='')}")
        if as_json:
            print_json(out)
            return
        for field in ("name", "org", "team", "band"):
            if field in out:
                click.echo(f"{field}: {out[field] or '-'}")
        for field in ("teams", "projects", "users", "keys"):
            if field in out:
                click.echo(f"{field}: {', '.join(out[field]) or '-'}")
        lim = out["limits"]
        shown = ", ".join(
            f"{k} {lim[k]}" for k in tenancy.LIMIT_KINDS if lim and lim[k] is not None
        )
        click.echo(f"limits: {shown or '-'}")
        for b in out["budgets"]:
            click.echo(f"budget per {b['period']}: {budget_text(b)}")

    group_show.help = f"Show a {kind}: its members, keys, limits and budgets."

    @group.command("remove")
    @click.argument("name")
    @store_option
    @pass_state
    def group_remove(state, name, direct):
        if direct:
            direct_call(state, tenancy.remove, kind, name, time.time())
            audit.record(f"{plural}.remove", actor(), "local", name)
        else:
            client(state).post(f"/v1/{plural}/{quote(name, safe='')}/remove", {})
        click.echo(f"removed {kind} {name}", err=True)

    group_remove.help = (
        f"Remove a {kind} that nothing refers to any more, with its limits and budgets."
    )

    if kind == "project":

        @group.command("band")
        @click.argument("name")
        @click.argument("band")
        @json_option
        @store_option
        @pass_state
        def projects_band(state, name, band, as_json, direct):
            """Set a project's priority band ('none' clears it)."""
            band = "" if band == "none" else band
            if direct:
                out = direct_call(state, tenancy.set_band, name, band, time.time(),
                                  bands_of(state))  # fmt: skip
                audit.record("projects.band", actor(), "local", name, band=out["band"])
            else:
                out = client(state).post(
                    f"/v1/projects/{quote(name, safe='')}/band", {"band": band}
                )
            if as_json:
                print_json(out)
            else:
                click.echo(f"project {name}: band {out['band'] or '-'}", err=True)

    return group


def budget_text(b: dict) -> str:
    parts = []
    if b["tokens"] is not None:
        parts.append(f"{b['used'].get('tokens', 0):,}/{b['tokens']:,} tokens")
    if b["cost"] is not None:
        parts.append(f"{b['used'].get('cost', 0):,.4f}/{b['cost']:,.4f} cost")
    return ", ".join(parts)


orgs = make_group("org")
teams = make_group("team")
projects = make_group("project")
users = make_group("user")
