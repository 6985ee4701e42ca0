"""`llmgw keys`: create, list and revoke API keys, through the admin API.

`--store` changes the store directly instead, for when no scheduler runs yet (the
first key of a new install, tests); the change is still put in the audit log.
"""

import time

import click

from llmgw import apikeys, audit, tenancy
from llmgw.errors import TenancyError
from llmgw_ctl.api import actor, client
from llmgw_ctl.common import pass_state, print_json, print_table, when

store_option = click.option(
    "--store",
    "direct",
    is_flag=True,
    help="Change the store directly, not through the scheduler (needs the store's URL).",
)


@click.group("keys", invoke_without_command=True)
@click.pass_context
def keys(ctx):
    """API keys for the router (the default command is `list`).

    \b
    Examples:
      llmgw keys create --name ci --models gemma3-270m --expires 30d
      llmgw keys create --name bot --user ada@acme.org --project chatbot --band gold
      llmgw keys list --json | jq -r '.[] | select(.state=="active") | .id'
      llmgw keys revoke key_1a2b3c4d5e6f
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(keys_list)


@keys.command("create")
@click.option("--name", required=True, help="What the key is for, e.g. a team or a service.")
@click.option("--models", default="", help="Comma-separated models it may use (default: all).")
@click.option("--expires", help="Lifetime, e.g. 12h, 30d, 8w (default: never).")
@click.option("--user", help="The user it belongs to (`llmgw users create`).")
@click.option("--project", help="The project it works for, in the user's org.")
@click.option("--band", help="Its priority band (router.bands; default: the project's).")
@click.option("--json", "as_json", is_flag=True, help="Print the key and its secret as JSON.")
@store_option
@pass_state
def keys_create(state, name, models, expires, user, project, band, as_json, direct):
    """Create a key and print its secret, which is shown this once only.

    Its usage is counted against its user and project, their teams and org, and every
    limit and budget on them applies (`llmgw limits`, `llmgw budgets`).
    """
    model_list = [m.strip() for m in models.split(",") if m.strip()]
    try:
        expires_in = apikeys.parse_duration(expires) if expires else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--expires") from None
    if not name.strip():
        raise click.BadParameter("must not be empty", param_hint="--name")
    if direct:
        state.store()
        now = time.time()
        try:
            user, project = tenancy.key_owner(user, project)
            band = tenancy.check_band(band, state.cfg.router.bands)
        except TenancyError as e:
            raise click.ClickException(str(e)) from None
        row, secret = apikeys.create(name.strip(), model_list, expires_in, now, user, project,
                                     band)  # fmt: skip
        audit.record("keys.create", actor(), "local", row.id, name=row.name,
                     models=model_list or None, expires_in=expires_in, user=user,
                     project=project, band=band or None)  # fmt: skip
        key = {**apikeys.key_json(row, now), "secret": secret}
    else:
        body = {"name": name.strip(), "models": model_list, "expires_in": expires_in,
                "user": user, "project": project, "band": band}  # fmt: skip
        key = client(state).post("/v1/keys", body)
    if as_json:
        print_json(key)
        return
    click.echo(key["secret"])
    click.echo(
        f"Created {key['id']} ({key['name']}). The secret above is shown only now; "
        "the router accepts it within a few seconds.",
        err=True,
    )


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@click.option("--all", "show_all", is_flag=True, help="Include revoked and expired keys.")
@store_option
@pass_state
def keys_list(state, as_json, show_all, direct=False):
    """List keys (active ones, unless --all)."""
    if direct:
        state.store()
        rows = apikeys.listing(show_all, time.time())
    else:
        rows = client(state).get("/v1/keys", all="1" if show_all else None)
    if as_json:
        print_json(rows)
        return
    print_table(
        ["ID", "NAME", "PREFIX", "MODELS", "USER", "PROJECT", "BAND", "CREATED", "EXPIRES",
         "STATE"],
        [
            [r["id"], r["name"], r["prefix"] + "…", ",".join(r["models"]) or "*",
             r.get("user") or "-", r.get("project") or "-", r.get("band") or "-",
             when(r["created_at"]), when(r["expires_at"]), r["state"]]
            for r in rows
        ],
    )  # fmt: skip


@keys.command("revoke")
@click.argument("key_ids", nargs=-1, required=True, metavar="ID...")
@store_option
@pass_state
def keys_revoke(state, key_ids, direct):
    """Revoke keys by id (all or none); the router refuses them within a few seconds.

    Ids can come from a pipeline: llmgw keys list --json | jq -r '.[].id' | xargs llmgw keys revoke
    """
    if direct:
        state.store()
        missing = apikeys.revoke(list(key_ids), time.time())
        if missing:
            raise click.ClickException(f"no such key: {', '.join(missing)} (see `llmgw keys list`)")
        for key_id in key_ids:
            audit.record("keys.revoke", actor(), "local", key_id)
    else:
        client(state).post("/v1/keys/revoke", {"ids": list(key_ids)})
    for key_id in key_ids:
        click.echo(f"revoked {key_id}", err=True)


@keys.command("rotate-scheduler")
@click.option("--finish", is_flag=True, help="Serve with the new keypair from now on.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's answer as JSON.")
@pass_state
def keys_rotate_scheduler(state, finish, as_json):
    """Replace the scheduler's CURVE keypair, with an overlap so nothing is cut off.

    \b
    1. llmgw keys rotate-scheduler
         makes scheduler.next.key(_secret) beside scheduler.key on the scheduler.
    2. Copy scheduler.next.key to every agent and router, into their pki/curve/
       beside scheduler.key (no restart: they read it when a handshake fails).
    3. llmgw keys rotate-scheduler --finish
         the scheduler serves with the new keypair (the old one is kept as
         scheduler.retired.key*); every peer reconnects with the next key.
    4. On every peer, move scheduler.next.key over scheduler.key: the old key retires.

    With a standby, copy both scheduler.next.key* files to it and run --finish on it
    too (--admin-url); peers try either key on each scheduler.
    """
    out = client(state).post("/v1/scheduler-key/rotate", {"finish": finish})
    if as_json:
        print_json(out)
        return
    if out["step"] == "begin":
        click.echo(
            f"scheduler {out['scheduler']}: the next public key is {out['public_key']}\n"
            f"copy {out['dir']}/scheduler.next.key to every agent and router's pki/curve/,"
            " then run: llmgw keys rotate-scheduler --finish"
        )
    else:
        click.echo(
            f"scheduler {out['scheduler']} serves with {out['public_key']}; on every peer,"
            " move scheduler.next.key over scheduler.key"
        )
