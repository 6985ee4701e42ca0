"""Write docs/cli.md from the commands' own --help, and the example config into
docs/configuration.md, so the reference never drifts.

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


CONFIG_DOC = OUT.parent / "configuration.md"


def render_config() -> str:
    """docs/configuration.md: its prose, then the example config as it is."""
    from llmgw import config

    text = CONFIG_DOC.read_text()
    head = text[: text.index("```toml\n") + len("```toml\n")]
    return head + config.example() + "```\n"


if __name__ == "__main__":
    pages = {OUT: render(), CONFIG_DOC: render_config()}
    if "--check" in sys.argv:
        stale = [str(p) for p, text in pages.items() if not p.exists() or p.read_text() != text]
        if stale:
            sys.exit(f"{', '.join(stale)} stale: run `make docs`")
        sys.exit(0)
    for path, text in pages.items():
        path.write_text(text)
