"""`llmgw store`: the store's schema."""

from pathlib import Path

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
        db = open_store(url, timeout_s=state.cfg.store.timeout_s)
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


@store.command("init")
@click.option(
    "--admin-url",
    required=True,
    metavar="URL",
    help="A PostgreSQL superuser's URL, e.g. postgresql://postgres@db1/postgres.",
)
@click.option("--name", default="llmgw", show_default=True, help="The role and database to make.")
@click.option(
    "--pgpass",
    type=click.Path(dir_okay=False, path_type=Path),
    default=lambda: str(Path.home() / ".pgpass"),
    show_default="~/.pgpass",
    help="Where the new role's password goes (libpq's password file).",
)
def store_init(admin_url, name, pgpass):
    """Create a role and a database for llmgw on a PostgreSQL server, migrate it, and
    print its store URL (for `[store] url` or LLMGW_STORE). The password is never in the
    URL: it is added to --pgpass, which the tools' user needs as ~/.pgpass (or
    PGPASSFILE).

    \b
    Examples:
      llmgw store init --admin-url postgresql://postgres@db1/postgres
      llmgw store init --admin-url postgresql://postgres@db1/postgres --name llmgw_staging \\
          --pgpass /var/lib/llmgw/.pgpass
    """
    from llmgw.store.provision import init_postgres

    try:
        url = init_postgres(admin_url, name, pgpass)
    except Error as e:
        raise click.ClickException(str(e)) from None
    click.echo(url)
    click.echo(f"created {name}, migrated; its password is in {pgpass}", err=True)
