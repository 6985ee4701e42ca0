"""llmgw-backup's command line: run, verify, restore, list."""

import json
import signal
import sys
from pathlib import Path

import click

from llmgw import backups as archive
from llmgw import cli, log
from llmgw.errors import Error
from llmgw.human import when
from llmgw_backup import restore, run, verify


class State(cli.ConfigState):
    def loaded(self, cfg) -> None:
        log.setup("llmgw-backup", cfg.log.level)

    def directory(self, asked: str | None) -> Path:
        """--dir, else backup.dir (relative to the config file), else paths.backup_dir."""
        if asked:
            return Path(asked).absolute()
        return self.cfg.backup_dir()


pass_state = click.make_pass_decorator(State)


def _sigterm(signum, frame):
    # systemd stops a unit with SIGTERM: unwind, so the .part file and the staging
    # directory are removed by the code that made them.
    raise SystemExit(128 + signum)


def print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2 if sys.stdout.isatty() else None))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _keys(n: int) -> str:
    return f"{n} API key" if n == 1 else f"{n} API keys"


class Command(click.Group):
    """Every llmgw error, and any OS error, is one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Error as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from None


@click.group(
    cls=Command,
    invoke_without_command=True,
    context_settings=cli.CONTEXT,
)
@cli.config_option
@cli.version_option
@click.pass_context
def main(ctx, config_path):
    """Archives of the store and the configuration directory (the default command is `list`).

    \b
    Examples:
      llmgw-backup run
      llmgw-backup list --json | jq -r '.[0].path'
      llmgw-backup verify /var/backups/llmgw/llmgw-20250101T030000Z.tar.gz
      llmgw-backup restore /var/backups/llmgw/llmgw-20250101T030000Z.tar.gz
    """
    signal.signal(signal.SIGTERM, _sigterm)
    ctx.obj = State(config_path)
    if ctx.invoked_subcommand is None:
        ctx.invoke(backup_list)


@main.command("run", short_help="Write one archive; prune old ones.")
@click.option("--dir", "directory", help="Where to write (default: backup.dir).")
@click.option("--keep", type=click.IntRange(min=0), help="Newest archives kept (default: 14).")
@click.option("--json", "as_json", is_flag=True, help="Print the archive as JSON.")
@pass_state
def backup_run(state, directory, keep, as_json):
    """Write one archive of the store and the configuration, then prune old ones.

    The archive is written as NAME.part and renamed when complete; only archives named
    llmgw-YYYYmmddTHHMMSSZ.tar.gz are pruned. Prints the archive's path.

    \b
    Examples:
      llmgw-backup run
      llmgw-backup run --dir /mnt/offsite --keep 30 --json
    """
    cfg = state.cfg
    result = run.backup(cfg, state.directory(directory), cfg.backup.keep if keep is None else keep)
    if as_json:
        print_json(result)
        return
    click.echo(result["path"])


@main.command("verify", short_help="Check an archive end to end.")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print what the archive holds as JSON.")
def backup_verify(path, as_json):
    """Check an archive: its manifest and sha256s, its store, the engine-key secret.

    \b
    Examples:
      llmgw-backup verify /var/backups/llmgw/llmgw-20250101T030000Z.tar.gz
      llmgw-backup list --json | jq -r '.[0].path' | xargs llmgw-backup verify
    """
    result = verify.verify(path)
    if as_json:
        print_json(result)
        return
    click.echo(
        f"{path}: ok ({result['store']} store, {_keys(result['api_keys'])}, engine-key"
        f" secret present, {result['config_files']} configuration files)"
    )


@main.command("restore", short_help="Restore the store, and the configuration where asked.")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--config-to",
    "config_to",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also restore the configuration files into this directory (e.g. /etc/llmgw).",
)
@click.option("--force", is_flag=True, help="Replace a store and files that are there.")
@click.option("--json", "as_json", is_flag=True, help="Print what was restored as JSON.")
@pass_state
def backup_restore(state, path, config_to, force, as_json):
    """Restore the store from an archive, and its configuration with --config-to.

    Stop llmgw first. A store that has tables, or configuration files that differ from
    the archive's, are replaced only with --force. Without --config-to no
    configuration file is written, so a check into a scratch database cannot touch the
    live configuration.

    \b
    Examples:
      llmgw-backup restore ARCHIVE --config-to /etc/llmgw     # disaster recovery
      LLMGW_STORE=postgresql://llmgw@db1/scratch llmgw-backup restore ARCHIVE
    """
    result = restore.restore(state.cfg, path, force, config_to)
    if as_json:
        print_json(result)
        return
    if config_to is None:
        config = (
            f"; its {result['config_files']} configuration files were not restored"
            " (--config-to DIR restores them)"
        )
    else:
        config = (
            f" and {len(result['config_written'])} files into {result['config_dir']}"
            f" ({result['config_unchanged']} already the same)"
        )
    click.echo(f"restored {result['store_url']} ({_keys(result['api_keys'])}) from {path}{config}")


@main.command("list")
@click.option("--dir", "directory", help="Where to look (default: backup.dir).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
@pass_state
def backup_list(state, directory, as_json):
    """Archives in the backup directory, newest first."""
    found = archive.archives(state.directory(directory))
    if as_json:
        print_json([a.json() for a in found])
        return
    rows = [["PATH", "SIZE", "CREATED"]]
    rows += [[str(a.path), _size(a.bytes), when(a.created_at)] for a in found]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
