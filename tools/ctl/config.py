"""`llmgw config`: print and check the configuration."""

import click

from llmgw import config as configmod
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
    """Load the config and report the first problem, if any."""
    cfg = state.cfg
    click.echo(f"{cfg.source or 'built-in defaults'}: ok")
