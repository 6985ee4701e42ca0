"""`llmgw` imports a command's module only when that command runs (tools/ctl/main.py)."""

import subprocess
import sys

import click

from llmgw_ctl.main import COMMANDS, cli


def test_every_command_is_found_under_its_own_name():
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(COMMANDS)
    for name in COMMANDS:
        assert cli.get_command(ctx, name).name == name
    assert cli.get_command(ctx, "no-such-command") is None
    assert {"add", "list", "remove"} <= set(cli.get_command(ctx, "models").commands)


def test_status_does_not_import_the_other_commands():
    code = (
        "import sys; from llmgw_ctl.main import cli\n"
        "try: cli(['status', '--help'])\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('llmgw_ctl.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert "llmgw_ctl.status" in out
    for other in ("llmgw_ctl.release", "llmgw_ctl.onboard", "llmgw_ctl.weights",
                  "llmgw_ctl.tenancy", "llmgw_ctl.keys"):  # fmt: skip
        assert other not in out, out
