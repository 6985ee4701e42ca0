"""llmgw-agentd's command line."""

import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import click
from prometheus_client import start_http_server

from llmgw import bus, cli, dirs, log, tracing
from llmgw import config as configmod
from llmgw.errors import Error
from llmgw_agentd import join
from llmgw_agentd.agent import Agent

_log = log.get("llmgw.agentd")


@click.group(context_settings=cli.CONTEXT, invoke_without_command=True)
@cli.config_option
@cli.version_option
@click.pass_context
def main(ctx, config_path):
    """Run this node's engines for the scheduler: one agent per node.

    Reports CPUs, memory and GPUs, installs engines, fetches weights, starts and
    stops engine processes. Engines outlive the agent: after a restart it adopts
    the ones still running. `join` makes this node one of the fleet first.

    \b
    Examples:
      llmgw-agentd --config /etc/llmgw/llmgw.toml
      LLMGW_CONFIG=./var/llmgw.toml llmgw-agentd
      llmgw-agentd join https://cp1:8081 llmgw-join-… --ca-sha256 3f9a…
    """
    ctx.obj = config_path
    if ctx.invoked_subcommand is None:
        serve(config_path)


@main.command("join")
@click.argument("url")
@click.argument("token")
@click.option(
    "--ca-sha256",
    required=True,
    metavar="FP",
    help="The cluster CA's fingerprint, as `llmgw nodes join-token` printed it.",
)
@click.pass_obj
def join_command(config_path, url, token, ca_sha256):
    """Join the fleet at URL (the scheduler's admin API, https) with a one-time TOKEN
    from `llmgw nodes join-token NAME`: check the CA, make this node's keypair, register
    it, and write the keys and (if there is none) the config naming this node."""
    file = Path(config_path or os.environ.get("LLMGW_CONFIG") or configmod.DEFAULT_PATH)
    try:
        cfg = configmod.load(config_path)
        name = join.run(cfg, file, url, token, ca_sha256)
    except Error as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"joined as {name}: start llmgw-agentd (systemctl enable --now llmgw-agentd)",
               err=True)  # fmt: skip


def serve(config_path) -> None:
    try:
        cfg = configmod.load(config_path)
        name = cfg.agent.name or socket.gethostname()
        keys = bus.load_keypair(cfg.curve_dir(), name)
        scheduler_public = bus.load_public(cfg.curve_dir(), bus.SCHEDULER, bus.copy_hint(name))
        # Engines, weights, logs and the replicas' state files: the unit's StateDirectory.
        dirs.writable(Path(cfg.paths.state_dir), "the agent's state")
        tracing.check(cfg.tracing)  # its endpoint goes to the vLLM engines it starts
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
