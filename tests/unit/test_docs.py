import subprocess
import sys

from tests.helpers import ROOT


def test_the_cli_reference_matches_the_commands_help():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen-cli-docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_the_configuration_page_shows_the_example_config_as_it_is():
    from llmgw import config

    assert config.example() in (ROOT / "docs" / "configuration.md").read_text()
