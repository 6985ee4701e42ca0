"""llmgw-scheduler's command line."""

import secrets
import signal
import socket
import time
from pathlib import Path

import click
from prometheus_client import start_http_server

from llmgw import bus, catalog, cli, dirs, log, tls, tracing
from llmgw import config as configmod
from llmgw.errors import Error
from llmgw.openfiles import raise_open_files
from llmgw.store import ClusterSecret, migrate, open_store, redact
from llmgw_scheduler import metrics
from llmgw_scheduler.admin import admin_token
from llmgw_scheduler.admin import serve as serve_admin
from llmgw_scheduler.leadership import Leadership, check_timings, store_timeout
from llmgw_scheduler.loop import Loop
from llmgw_scheduler.needs import Needs
from llmgw_scheduler.readings import Readings, check_refresh
from llmgw_scheduler.replicator import Replicator
from llmgw_scheduler.replicator import check_timings as check_replication
from llmgw_scheduler.service import Scheduler
from llmgw_scheduler.signon import SignOn
from llmgw_scheduler.usage_check import UsageCheck

_log = log.get("llmgw.scheduler")


def cluster_secret() -> str:
    """The secret engine keys derive from: made once, kept in the store."""
    row = ClusterSecret.get_or_none(ClusterSecret.name == "engine_keys")
    if row is None:
        ClusterSecret.insert(
            name="engine_keys", value=secrets.token_hex(32), created_at=time.time()
        ).on_conflict_ignore().execute()
        row = ClusterSecret.get(ClusterSecret.name == "engine_keys")
    return row.value


@click.command(context_settings=cli.CONTEXT)
@cli.config_option
@cli.version_option
def main(config_path):
    """Place models on nodes, keep them running, and publish the routing table.

    \b
    Examples:
      llmgw-scheduler --config /etc/llmgw/llmgw.toml
    """
    try:
        cfg = configmod.load(config_path)
        extra = {e.name for e in cfg.agent.engines}
        models = catalog.load(cfg.models, extra_engines=extra)
        check_timings(cfg)
        tracing.check(cfg.tracing)
        db = open_store(cfg.store_url(), timeout_s=store_timeout(cfg), bounded=True)
        migrate(db)
        secret = cluster_secret()
        keys_dir = cfg.curve_dir()
        bus.create_keypair(keys_dir, bus.SCHEDULER)
        keys = bus.load_keypair(keys_dir, bus.SCHEDULER)
        # Made (or read) here, not where the port is bound: a token that cannot be
        # written is its own error, not "cannot serve the admin API".
        token = admin_token(cfg)
        signon = SignOn(cfg.oidc) if cfg.oidc.issuer else None
        check_replication(cfg)
        check_refresh(cfg)
        dirs.writable(Path(cfg.paths.state_dir), "the scheduler's state")
    except Error as e:
        raise click.ClickException(str(e)) from None
    log.setup("llmgw-scheduler", cfg.log.level)
    tracing.setup(cfg.tracing, "llmgw-scheduler")  # admin requests and placement passes
    needs = Needs(Path(cfg.paths.state_dir) / "weights")
    needs.load_measured()
    needs.load_mirrored()
    for m in models:
        needs.estimate(m)
    # The lease calls back from start() on, by when `sched` exists: each holds the other.
    leadership = lead(cfg, db, lambda epoch, leading: sched.leadership_changed(epoch, leading))
    sched = Scheduler(cfg, models, secret, needs, leadership=leadership, name=leadership.name,
                      config_names={m.name for m in cfg.models}, extra_engines=extra)  # fmt: skip
    sched.load(list(cfg.models))
    sched.commands.mirror_url = leadership.admin_url
    open_files = raise_open_files()  # a connection per agent, two per router
    try:
        leadership.start()  # with SQLite: refuses if another scheduler runs on the store
        loop = Loop(sched, keys, cfg)
    except Error as e:
        leadership.stop()
        raise click.ClickException(str(e)) from None
    try:
        ssl_context = None
        if cfg.scheduler.admin_tls_cert or cfg.scheduler.admin_tls_key:
            ssl_context = tls.server_context(
                cfg.file(cfg.scheduler.admin_tls_cert), cfg.file(cfg.scheduler.admin_tls_key)
            )
        admin = serve_admin(
            sched,
            cfg.scheduler.admin_listen,
            token,
            ssl_context,
            cfg=cfg,
            bus_auth=loop.auth,
            loop=loop,
            signon=signon,
        )
    except OSError as e:
        loop.close()
        leadership.stop()
        raise click.ClickException(
            f"cannot serve the admin API on {cfg.scheduler.admin_listen}: {e.strerror or e}"
        ) from None
    metrics.watch_backups(cfg.backup_dir())
    metrics.watch_fleet(sched)
    check = UsageCheck(sched, cfg.usage, db)
    check.start()
    sched.readings = Readings(sched, db, cfg.scheduler.status_refresh_s)
    sched.readings.start()
    sched.replicator = Replicator(cfg, db, leadership.name, secret, sched.leading)
    sched.replicator.start()
    if cfg.scheduler.metrics_listen:
        host, port = cli.parse_listen(cfg.scheduler.metrics_listen)
        if port:
            start_http_server(port, addr=host)

    def stop(signum, frame):
        loop.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _log.info(
        "starting",
        bus=cfg.scheduler.bus,
        publish=cfg.scheduler.publish,
        store=redact(cfg.store_url()),
        models=",".join(m.name for m in models) or "none",
        open_files=open_files,
    )
    try:
        loop.run()
    finally:
        check.stop()
        sched.readings.stop()
        sched.replicator.stop()
        admin.shutdown()
        loop.close()
        leadership.stop()  # hands the lease over at once
        tracing.shutdown()
    _log.info("stopped")


def lead(cfg, db, on_change) -> Leadership:
    """The lease; `on_change(epoch, leading)` is called on a takeover and a loss (from
    `start()` on, once the scheduler it names exists)."""
    try:
        check_timings(cfg)
    except Error as e:
        raise click.ClickException(str(e)) from None
    s = cfg.scheduler
    name = s.name or socket.gethostname()
    scheme = "https" if s.admin_tls_cert else "http"
    admin_url = s.admin_url or f"{scheme}://{s.admin_listen}"
    return Leadership(db, cfg, name, admin_url, on_change=on_change)
