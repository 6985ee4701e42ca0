"""`llmgw config`: print and check the configuration."""

import click

from llmgw import catalog
from llmgw import config as configmod
from llmgw.errors import Error
from llmgw_ctl.common import pass_state


@click.group("config")
def config():
    """The configuration file."""


@config.command("example")
def config_example():
    """Print a fully commented sample config with every default.

    \b
    Example:
      llmgw config example > /etc/llmgw/llmgw.toml
    """
    click.echo(configmod.example(), nl=False)


@config.command("check")
@pass_state
def config_check(state):
    """Load the config and check it as the tools do at start: the first problem, if any.

    The catalog is checked by the same function the scheduler and the router call, so
    "ok" means neither refuses it.
    """
    cfg = state.cfg
    try:
        catalog.from_config(cfg)
    except Error as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{cfg.source or 'built-in defaults'}: ok")
