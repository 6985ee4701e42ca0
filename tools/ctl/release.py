"""`llmgw release`: publish llmgw wheels to the control plane's release directory, and
list them. Nodes are onboarded and upgraded from there, never from a checkout."""

from pathlib import Path
from urllib.parse import quote

import click

from llmgw.errors import Invalid
from llmgw.human import size
from llmgw.releases import wheel_version
from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table, when


@click.group("release", invoke_without_command=True)
@click.pass_context
def release(ctx):
    """llmgw releases on the control plane (the default command is `list`).

    \b
    Examples:
      make release
      llmgw release publish dist/llmgw-0.2.1rc1-py3-none-any.whl
      llmgw release list --json | jq -r '.[-1].version'
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(release_list)


@release.command("publish")
@click.argument("wheel", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the release as JSON.")
@pass_state
def release_publish(state, wheel, as_json):
    """Put WHEEL (from `make release`) into the control plane's release directory
    (scheduler.release_dir). Publishing the same wheel again changes nothing; a
    different wheel with a published version is refused: publish the next rc."""
    try:
        wheel_version(wheel.name)
    except Invalid as e:
        raise click.ClickException(str(e)) from None
    out = client(state).upload(f"/v1/releases/{quote(wheel.name, safe='')}", wheel)
    if as_json:
        print_json(out)
    else:
        said = "published" if out["new"] else "already published"
        click.echo(f"{said}: llmgw {out['version']} ({out['sha256'][:12]})", err=True)


@release.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the releases as JSON.")
@pass_state
def release_list(state, as_json):
    """Published releases, oldest first by version (PEP 440: 0.2.0 < 0.2.1rc1 < 0.2.1);
    the last is what onboarding installs."""
    rows = client(state).get("/v1/releases")
    if as_json:
        return print_json(rows)
    print_table(
        ["VERSION", "FILE", "SIZE", "SHA256", "PUBLISHED"],
        [[r["version"], r["filename"], size(r["size"]), r["sha256"][:12],
          when(r["published"])] for r in rows],
    )  # fmt: skip
