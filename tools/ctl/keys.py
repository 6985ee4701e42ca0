"""`llmgw keys`: create, list and revoke API keys."""

import time

import click

from llmgw import apikeys
from llmgw.store import ApiKey
from llmgw_ctl.common import pass_state, print_json, print_table, when


def key_json(row: ApiKey, now: float) -> dict:
    """The one JSON shape of a key, used by every command that prints keys."""
    return {
        "id": row.id,
        "name": row.name,
        "prefix": row.prefix,
        "models": row.model_list,
        "created_at": row.created_at,
        "expires_at": row.expires_at,
        "revoked_at": row.revoked_at,
        "state": state_of(row, now),
    }


def state_of(row: ApiKey, now: float) -> str:
    if row.revoked_at is not None:
        return "revoked"
    if row.expires_at is not None and row.expires_at <= now:
        return "expired"
    return "active"


@click.group("keys", invoke_without_command=True)
@click.pass_context
def keys(ctx):
    """API keys for the router (the default command is `list`).

    \b
    Examples:
      llmgw keys create --name ci --models gemma3-270m --expires 30d
      llmgw keys list --json | jq -r '.[] | select(.state=="active") | .id'
      llmgw keys revoke key_1a2b3c4d5e6f
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(keys_list)


@keys.command("create")
@click.option("--name", required=True, help="What the key is for, e.g. a team or a service.")
@click.option("--models", default="", help="Comma-separated models it may use (default: all).")
@click.option("--expires", help="Lifetime, e.g. 12h, 30d, 8w (default: never).")
@click.option("--json", "as_json", is_flag=True, help="Print the key and its secret as JSON.")
@pass_state
def keys_create(state, name, models, expires, as_json):
    """Create a key and print its secret, which is shown this once only."""
    model_list = [m.strip() for m in models.split(",") if m.strip()]
    try:
        expires_in = apikeys.parse_duration(expires) if expires else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--expires") from None
    if not name.strip():
        raise click.BadParameter("must not be empty", param_hint="--name")
    state.store()
    row, secret = apikeys.create(name.strip(), model_list, expires_in)
    if as_json:
        print_json({**key_json(row, time.time()), "secret": secret})
        return
    click.echo(secret)
    click.echo(
        f"Created {row.id} ({row.name}). The secret above is shown only now; "
        "the router accepts it within a few seconds.",
        err=True,
    )


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--all", "show_all", is_flag=True, help="Include revoked and expired keys.")
@pass_state
def keys_list(state, as_json, show_all):
    """List keys (active ones, unless --all)."""
    state.store()
    now = time.time()
    rows = [
        r
        for r in ApiKey.select().order_by(ApiKey.created_at)
        if show_all or state_of(r, now) == "active"
    ]
    if as_json:
        print_json([key_json(r, now) for r in rows])
        return
    print_table(
        ["ID", "NAME", "PREFIX", "MODELS", "CREATED", "EXPIRES", "STATE"],
        [
            [
                r.id,
                r.name,
                r.prefix + "…",
                ",".join(r.model_list) or "*",
                when(r.created_at),
                when(r.expires_at),
                state_of(r, now),
            ]
            for r in rows
        ],
    )


@keys.command("revoke")
@click.argument("key_ids", nargs=-1, required=True, metavar="ID...")
@pass_state
def keys_revoke(state, key_ids):
    """Revoke keys by id; the router refuses them within a few seconds.

    Ids can come from a pipeline: llmgw keys list --json | jq -r '.[].id' | xargs llmgw keys revoke
    """
    state.store()
    now = time.time()
    missing = [k for k in key_ids if ApiKey.get_or_none(ApiKey.id == k) is None]
    if missing:
        raise click.ClickException(f"no such key: {', '.join(missing)} (see `llmgw keys list`)")
    for key_id in key_ids:
        ApiKey.update(revoked_at=now, updated_at=now).where(
            (ApiKey.id == key_id) & ApiKey.revoked_at.is_null()
        ).execute()
        click.echo(f"revoked {key_id}", err=True)
