"""What every llmgw executable's command line shares: -h, --version, --config, HOST:PORT."""

import click

from llmgw import __version__

CONTEXT = {"help_option_names": ["-h", "--help"]}

config_option = click.option(
    "--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(),
    help="Config file (default /etc/llmgw/llmgw.toml).",
)  # fmt: skip

version_option = click.version_option(__version__, "--version")


def parse_listen(text: str, what: str = "listen") -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port); a bad one is a one-line error."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise click.ClickException(f"{what} {text!r}: want HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]") or "0.0.0.0", int(port)
