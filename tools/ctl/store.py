"""`llmgw store`: the store's schema."""

import click

from llmgw.errors import Error
from llmgw.store import migrate, open_store, pending, redact
from llmgw_ctl.common import pass_state


@click.group("store")
def store():
    """The store (SQLite or PostgreSQL) that every tool shares."""


@store.command("migrate")
@click.option("--check", is_flag=True, help="Apply nothing; exit 1 if migrations are pending.")
@pass_state
def store_migrate(state, check):
    """Bring the store's schema up to date.

    \b
    Examples:
      llmgw store migrate
      LLMGW_STORE=postgresql://llmgw@db1/llmgw llmgw store migrate --check
    """
    url = state.cfg.store_url()
    try:
        db = open_store(url)
        if check:
            todo = pending(db)
            for name in todo:
                click.echo(name)
            if todo:
                raise SystemExit(1)
            return
        applied = migrate(db)
    except Error as e:
        raise click.ClickException(str(e)) from None
    for name in applied:
        click.echo(f"applied {name}")
    click.echo(f"{redact(url)}: up to date", err=True)
