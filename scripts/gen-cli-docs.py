"""Write docs/cli.md from the commands' own --help, so the reference never drifts.

python scripts/gen-cli-docs.py           rewrite docs/cli.md
python scripts/gen-cli-docs.py --check   exit 1 if docs/cli.md is stale
"""

import sys
from pathlib import Path

import click

from llmgw_agentd.main import main as agentd
from llmgw_backup.main import main as backup
from llmgw_certmon.main import main as certmon
from llmgw_ctl.main import cli
from llmgw_router.main import main as router
from llmgw_scheduler.main import main as scheduler

OUT = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def sections(cmd: click.Command, path: list[str], parent: click.Context | None = None):
    ctx = click.Context(
        cmd, parent=parent, info_name=path[-1], terminal_width=88, **cmd.context_settings
    )
    yield path, cmd.get_help(ctx)
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.list_commands(ctx)):
            yield from sections(cmd.get_command(ctx, name), [*path, name], ctx)


def render() -> str:
    parts = [
        "# Command-line reference\n",
        "Generated from `--help` by `make docs`; do not edit by hand.\n",
    ]
    tools = (
        (cli, "llmgw"),
        (router, "llmgw-router"),
        (scheduler, "llmgw-scheduler"),
        (agentd, "llmgw-agentd"),
        (backup, "llmgw-backup"),
        (certmon, "llmgw-certmon"),
    )
    for root, name in tools:
        for path, text in sections(root, [name]):
            parts.append(f"## `{' '.join(path)}`\n\n```\n{text}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            sys.exit(f"{OUT} is stale: run `make docs`")
        sys.exit(0)
    OUT.write_text(text)
