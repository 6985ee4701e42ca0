"""The `llmgw` command group."""

import importlib

import click

from llmgw import cli as cli_common
from llmgw_ctl.common import State

# Each command's module, imported only when the command runs (or `--help` lists them
# all). Importing every command's dependencies (the store, ZeroMQ, the release and
# onboarding code) made up most of what `llmgw status` took on a loaded control plane
# (bench/FLEET_SCALE.md). `models` comes from catalog.py, which adds `models add` and
# `models remove` to status.py's group.
COMMANDS = {
    "admin-token": "operators:admin_token", "audit": "audit:audit",
    "budgets": "limits:budgets", "config": "config:config", "drain": "drain:drain",
    "explain-placement": "status:explain_placement", "fabric": "fabric:fabric",
    "keys": "keys:keys", "limits": "limits:limits", "login": "signon:login",
    "logout": "signon:logout", "logs": "logs:logs",
    "models": "catalog:models", "nodes": "nodes:nodes", "operators": "operators:operators",
    "orgs": "tenancy:orgs", "projects": "tenancy:projects", "release": "release:release",
    "replicas": "status:replicas", "restart": "restart:restart", "retry": "status:retry",
    "routers": "nodes:routers", "scale": "catalog:scale", "status": "status:status",
    "store": "store:store", "teams": "tenancy:teams", "undrain": "drain:undrain",
    "usage": "usage:usage", "users": "tenancy:users", "weights": "weights:weights",
}  # fmt: skip


class LazyGroup(click.Group):
    """A group whose commands (COMMANDS) are imported when asked for."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx, name: str):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(f"llmgw_ctl.{module}"), attr)


@click.group(cls=LazyGroup, context_settings=cli_common.CONTEXT)
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
