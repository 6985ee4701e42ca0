"""llmgw-agentd's command line."""

import logging
import signal
import socket
import sys
import threading
from pathlib import Path

import click
from prometheus_client import start_http_server

from llmgw import bus, cli, dirs, log
from llmgw import config as configmod
from llmgw.errors import Error
from llmgw_agentd.agent import Agent

_log = log.get("llmgw.agentd")


@click.command(context_settings=cli.CONTEXT)
@cli.config_option
@cli.version_option
def main(config_path):
    """Run this node's engines for the scheduler: one agent per node.

    Reports CPUs, memory and GPUs, installs engines, fetches weights, starts and
    stops engine processes. Engines outlive the agent: after a restart it adopts
    the ones still running.

    \b
    Examples:
      llmgw-agentd --config /etc/llmgw/llmgw.toml
      LLMGW_CONFIG=./var/llmgw.toml llmgw-agentd
    """
    try:
        cfg = configmod.load(config_path)
        name = cfg.agent.name or socket.gethostname()
        keys = bus.load_keypair(cfg.curve_dir(), name)
        scheduler_public = bus.load_public(cfg.curve_dir(), bus.SCHEDULER, bus.copy_hint(name))
        # Engines, weights, logs and the replicas' state files: the unit's StateDirectory.
        dirs.writable(Path(cfg.paths.state_dir), "the agent's state")
    except Error as e:
        raise click.ClickException(str(e)) from None
    if not cfg.agent.schedulers:
        raise click.ClickException("agent.schedulers is empty: name at least one scheduler")
    log.setup("llmgw-agentd", cfg.log.level)
    # Readiness probes would otherwise log a connection line every 200 ms at debug level.
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    host, port = cli.parse_listen(cfg.agent.metrics_listen)
    if port:
        try:
            start_http_server(port, host)
        except OSError as e:
            raise click.ClickException(
                f"cannot serve metrics on {host}:{port}: {e.strerror}"
            ) from None

    stop = threading.Event()

    def on_signal(signum, frame):
        # Leave the engines running: models stay up across an agent restart or upgrade.
        _log.info("signal", name=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    Agent(cfg, keys, scheduler_public).run(stop)
    sys.exit(0)


if __name__ == "__main__":
    main()
