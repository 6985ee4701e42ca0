"""The `llmgw` command group."""

import click

from llmgw import __version__
from llmgw_ctl.common import State
from llmgw_ctl.config import config
from llmgw_ctl.keys import keys
from llmgw_ctl.nodes import nodes, routers
from llmgw_ctl.store import store


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    envvar="LLMGW_CONFIG",
    type=click.Path(),
    help="Config file (default /etc/llmgw/llmgw.toml).",
)
@click.version_option(__version__, "--version")
@click.pass_context
def cli(ctx, config_path):
    """Operate llmgw: keys, nodes, the store and the configuration.

    \b
    Examples:
      llmgw keys create --name demo
      llmgw store migrate
      llmgw config example > llmgw.toml
    """
    ctx.obj = State(config_path)


cli.add_command(keys)
cli.add_command(store)
cli.add_command(config)
cli.add_command(nodes)
cli.add_command(routers)
