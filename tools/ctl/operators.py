"""`llmgw operators` and `llmgw admin-token`: who may use the admin API, and how.

Each operator has their own token and a role: `read` (status, lists, logs, the audit
log, the page) or `admin` (changes too). The audit log names the operator whose token
made a change. The shared bootstrap token (`<config_dir>/secrets/admin.token`) acts as
`admin`; it makes the first operators, and `llmgw admin-token rotate` replaces it.
"""

import click

from llmgw import operators as ops
from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table, when


@click.group("operators", invoke_without_command=True)
@click.pass_context
def operators(ctx):
    """Admin API tokens, one per person or script (the default command is `list`).

    \b
    Examples:
      llmgw operators add ada --role admin
      llmgw operators add grafana --role read --json | jq -r .token > grafana.token
      llmgw operators remove ada
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(operators_list)


@operators.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def operators_list(state, as_json):
    """Operators and their roles (never their tokens)."""
    rows = client(state).get("/v1/operators")
    if as_json:
        print_json(rows)
        return
    print_table(
        ["NAME", "ROLE", "CREATED"], [[r["name"], r["role"], when(r["created_at"])] for r in rows]
    )


@operators.command("add")
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(ops.ROLES),
    default=ops.READ,
    show_default=True,
    help="read: look only; admin: change things too.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the operator and its token as JSON.")
@pass_state
def operators_add(state, name, role, as_json):
    """Make an operator and print their token, which is shown this once only.

    Give it to them as LLMGW_ADMIN_TOKEN, or for the status page as /status?token=….
    """
    op = client(state).post("/v1/operators", {"name": name, "role": role})
    if as_json:
        print_json(op)
        return
    click.echo(op["token"])
    if click.get_text_stream("stderr").isatty():
        click.echo(f"operator {name} ({role}): the token above is shown once", err=True)


@operators.command("remove")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the API's answer as JSON.")
@pass_state
def operators_remove(state, name, as_json):
    """Remove an operator: their token stops working at once."""
    out = client(state).delete(f"/v1/operators/{name}")
    if as_json:
        print_json(out)
    else:
        click.echo(f"removed operator {name}")


@click.group("admin-token")
def admin_token():
    """The bootstrap admin token of the scheduler the command reaches.

    \b
    Examples:
      llmgw admin-token rotate > /root/admin.token
      llmgw --admin-url https://s2:8091 admin-token rotate
    """


@admin_token.command("rotate")
@click.option("--json", "as_json", is_flag=True, help="Print the scheduler and token as JSON.")
@pass_state
def admin_token_rotate(state, as_json):
    """Replace the scheduler's bootstrap token and print the new one; the old one
    stops working at once.

    Each scheduler keeps its own token file: rotate a standby's through its own
    --admin-url. A token set as scheduler.admin_token in the config is changed there.
    """
    out = client(state).post("/v1/admin-token/rotate")
    if as_json:
        print_json(out)
    else:
        click.echo(out["token"])
