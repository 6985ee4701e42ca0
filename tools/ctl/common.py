"""What every `llmgw` subcommand shares: the loaded config, the store, output helpers."""

import json
import sys

import click

from llmgw import cli
from llmgw.errors import Error
from llmgw.human import when  # noqa: F401  (re-exported for the commands)
from llmgw.store import migrate, open_store


class State(cli.ConfigState):
    def __init__(self, config_path, admin_url=None, admin_token=None):
        super().__init__(config_path)
        self.admin_url = admin_url  # --admin-url / LLMGW_ADMIN_URL; None: from the config
        self.admin_token = admin_token  # --token / LLMGW_ADMIN_TOKEN; None: config or file

    def store(self):
        """The store, migrated: the CLI may be the first tool to touch it."""
        try:
            db = open_store(self.cfg.store_url(), timeout_s=self.cfg.store.timeout_s)
            migrate(db)
        except Error as e:
            raise click.ClickException(str(e)) from None
        return db


pass_state = click.make_pass_decorator(State)

# For commands that queue a change: print the API's answer instead of a line on stderr.
json_option = click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")


def queued(body: dict, as_json: bool, words: str) -> None:
    """Say a queued change was accepted: the API's JSON, or 'queued: ...' on stderr."""
    if as_json:
        print_json(body)
    else:
        click.echo(f"queued: {words}", err=True)


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2 if sys.stdout.isatty() else None))


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    """Aligned columns for people."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(str(c))) for w, c in zip(widths, row, strict=True)]
    for row in [headers, *rows]:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
