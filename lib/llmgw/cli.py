"""What every llmgw executable's command line shares: -h, --version, --config, HOST:PORT."""

import click

from llmgw import __version__
from llmgw import config as configmod
from llmgw.errors import Error

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


class ConfigState:
    """A command group's state: the config, loaded on first use (so `--help` works
    without one); a bad config is a one-line error. `loaded()` runs once after."""

    def __init__(self, config_path):
        self.config_path = config_path
        self._cfg = None

    @property
    def cfg(self) -> configmod.Config:
        if self._cfg is None:
            try:
                self._cfg = configmod.load(self.config_path)
            except Error as e:
                raise click.ClickException(str(e)) from None
            self.loaded(self._cfg)
        return self._cfg

    def loaded(self, cfg: configmod.Config) -> None:
        pass
