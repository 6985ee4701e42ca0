"""The `llmgw` command group."""

import click

from llmgw import cli as cli_common
from llmgw_ctl.audit import audit
from llmgw_ctl.catalog import scale
from llmgw_ctl.common import State
from llmgw_ctl.config import config
from llmgw_ctl.drain import drain, undrain
from llmgw_ctl.fabric import fabric
from llmgw_ctl.keys import keys
from llmgw_ctl.limits import budgets, limits
from llmgw_ctl.logs import logs
from llmgw_ctl.nodes import nodes, routers
from llmgw_ctl.operators import admin_token, operators
from llmgw_ctl.release import release
from llmgw_ctl.restart import restart
from llmgw_ctl.signon import login, logout
from llmgw_ctl.status import explain_placement, models, replicas, retry, status
from llmgw_ctl.store import store
from llmgw_ctl.tenancy import orgs, projects, teams, users
from llmgw_ctl.usage import usage
from llmgw_ctl.weights import weights


@click.group(context_settings=cli_common.CONTEXT)
@cli_common.config_option
@click.option(
    "--admin-url",
    envvar="LLMGW_ADMIN_URL",
    metavar="URL",
    help="The scheduler's admin API (default http:// + scheduler.admin_listen).",
)
@click.option(
    "--token",
    "admin_token",
    envvar="LLMGW_ADMIN_TOKEN",
    metavar="TOKEN",
    help="Admin API token (default: the ID token `llmgw login` kept for the admin URL, else"
    " scheduler.admin_token, else <config_dir>/secrets/admin.token).",
)
@cli_common.version_option
@click.pass_context
def cli(ctx, config_path, admin_url, admin_token):
    """Operate llmgw: the fleet's state, keys, tenancy, limits, usage, nodes, the store
    and the configuration.

    \b
    Examples:
      llmgw login
      llmgw status
      llmgw explain-placement gemma3-270m
      llmgw keys create --name demo
      llmgw limits set --user ada@acme.org --rpm 60
      llmgw usage --by org --since 30d
      llmgw store migrate
      llmgw config example > llmgw.toml
    """
    ctx.obj = State(config_path, admin_url or None, admin_token or None)


cli.add_command(keys)
cli.add_command(store)
cli.add_command(config)
cli.add_command(drain)
cli.add_command(undrain)
cli.add_command(nodes)
cli.add_command(routers)
cli.add_command(status)
cli.add_command(models)
cli.add_command(replicas)
cli.add_command(explain_placement)
cli.add_command(retry)
cli.add_command(scale)
cli.add_command(logs)
cli.add_command(fabric)
cli.add_command(restart)
cli.add_command(audit)
cli.add_command(orgs)
cli.add_command(teams)
cli.add_command(projects)
cli.add_command(users)
cli.add_command(limits)
cli.add_command(budgets)
cli.add_command(usage)
cli.add_command(operators)
cli.add_command(admin_token)
cli.add_command(login)
cli.add_command(logout)
cli.add_command(release)
cli.add_command(weights)
