"""llmgw-router's command line."""

import asyncio
import gc
import signal
import sys

import click
import peewee
import uvloop
from aiohttp import web

from llmgw import bus, catalog, cli, log, tls, tracing
from llmgw import config as configmod
from llmgw.errors import Error
from llmgw.openfiles import raise_open_files
from llmgw.peers import name_of
from llmgw.store import BusPeer, migrate, open_store, redact
from llmgw_router import aiohttp_app, http1, metrics
from llmgw_router.app import Router
from llmgw_router.feed import Feed
from llmgw_router.metrics import USAGE_SPOOL_ERRORS
from llmgw_router.prefix import PrefixIndex
from llmgw_router.routing import ROUTINGS, Endpoint, RoutingTable, parse_endpoint_flag
from llmgw_router.share import Share
from llmgw_router.spool import Spool, SpoolLocked

_log = log.get("llmgw.router")

TRANSPORTS = ("http1", "aiohttp")


@click.command(context_settings=cli.CONTEXT)
@cli.config_option
@click.option("--listen", help="HOST:PORT to serve on (overrides router.listen).")
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    metavar="ID=URL=MODEL[,MODEL]",
    help="An engine to route to, instead of [[router.endpoints]]. Repeatable.",
)
@cli.version_option
def main(config_path, listen, endpoints):
    """Serve the OpenAI-compatible API in front of the engines.

    \b
    Examples:
      llmgw-router --config /etc/llmgw/llmgw.toml
      llmgw-router --listen 127.0.0.1:8080 \\
          --endpoint gemma-0=http://127.0.0.1:8011=gemma3-270m
    """
    try:
        cfg = configmod.load(config_path)
        # Fail closed, as the scheduler does: a router that ran on without the catalog
        # would lose its prices (budgets uncounted) and fallbacks without a word.
        catalog.from_config(cfg)
        tracing.check(cfg.tracing)
    except Error as e:
        raise click.ClickException(str(e)) from None
    log.setup("llmgw-router", cfg.log.level)
    for name in ("max_engine_connections", "max_url_bytes", "max_header_bytes",
                 "header_timeout_s", "body_timeout_s", "idle_timeout_s",
                 "responses_chain_max"):  # fmt: skip
        if (value := getattr(cfg.router, name)) <= 0:
            raise click.ClickException(f"router.{name} = {value}: must be above 0")
    try:
        host, port = cli.parse_listen(listen or cfg.router.listen)
        if endpoints:
            eps = [parse_endpoint_flag(e) for e in endpoints]
        else:
            eps = [Endpoint(e.id, e.url, tuple(e.models), e.key) for e in cfg.router.endpoints]
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if not eps and not cfg.router.schedulers:
        _log.warning("no_endpoints", hint="give --endpoint, [[router.endpoints]] or schedulers")
    url = cfg.store_url()
    try:
        db = open_store(url, timeout_s=cfg.store.timeout_s, bounded=True)
        migrate(db)
        db.close()
    except Error as e:
        raise click.ClickException(str(e)) from None

    spool = None
    if cfg.router.usage_spool:
        spool = Spool(cfg.usage_spool_dir(), on_error=USAGE_SPOOL_ERRORS.inc)
        try:
            spool.open()
        except SpoolLocked as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            # Serve anyway: rows wait in memory (as before the spool), each one counted.
            _log.error(
                "usage_spool_failed",
                dir=str(spool.dir),
                reason=e.strerror or str(e),
                action="rows kept in memory until written",
            )

    rc = cfg.router
    if rc.transport not in TRANSPORTS:
        raise click.ClickException(
            f"router.transport = {rc.transport!r}: want one of {', '.join(TRANSPORTS)}"
        )
    if rc.routing not in ROUTINGS:
        raise click.ClickException(
            f"router.routing = {rc.routing!r}: want one of {', '.join(ROUTINGS)}"
        )
    table = RoutingTable(
        eps,
        cooldown_s=rc.cooldown_s,
        fed=bool(rc.schedulers),
        routing=rc.routing,
        prefix=PrefixIndex(
            alpha=rc.prefix_alpha,
            memory_bytes=rc.prefix_memory_mb << 20,
            hold_s=max(0.0, rc.prefix_hold_s),
        ),
    )
    share = make_share(cfg, table) if rc.prefix_share or rc.prefix_peers else None
    feed = None
    if cfg.router.schedulers:
        try:
            name = cfg.router.bus_name
            keys = bus.load_keypair(cfg.curve_dir(), name, "routers")
            hint = bus.copy_hint(name, "routers")
            server_public = bus.load_public(cfg.curve_dir(), bus.SCHEDULER, hint)
        except Error as e:
            raise click.ClickException(str(e)) from None
        feed = Feed(
            table,
            cfg.router.schedulers,
            keys,
            server_public,
            static=eps,
            bus_endpoints=cfg.router.scheduler_bus,
            name=cfg.router.bus_name,
            curve_dir=cfg.curve_dir(),
        )
    router = Router(cfg, table, db, feed, spool=spool)
    if share is not None:
        table.prefix.on_change = share.publish
    open_files = raise_open_files()
    _log.info(
        "starting",
        listen=f"{host}:{port}",
        store=redact(url),
        endpoints=",".join(e.id for e in eps) or "none",
        usage_spool=str(spool.dir) if spool is not None else "off",
        spool_segments_to_replay=len(spool.leftover) if spool is not None else 0,
        max_open_files=open_files,
    )
    ssl_context = None
    if cfg.router.tls_cert or cfg.router.tls_key:
        try:
            ssl_context = tls.server_context(
                cfg.file(cfg.router.tls_cert), cfg.file(cfg.router.tls_key)
            )
        except (OSError, ValueError) as e:
            raise click.ClickException(
                f"router.tls_cert/tls_key: cannot load {cfg.router.tls_cert}: {e}"
            ) from None
    # Spans go to the collector from a thread of the exporter's (tracing.py), if at all.
    tracing.setup(cfg.tracing, "llmgw-router")
    # The event loop takes the GIL back from another thread after 0.5 ms, not 5: the
    # usage writer (at a lower priority, preempted while holding the GIL) kept requests
    # waiting the whole 5 ms.
    sys.setswitchinterval(0.0005)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    if share is not None:
        try:
            share.start(loop)
        except Error as e:
            raise click.ClickException(f"router.prefix_share: {e}") from None
    if rc.transport == "aiohttp":
        try:
            web.run_app(
                aiohttp_app.build(router),
                host=host,
                port=port,
                ssl_context=ssl_context,
                loop=loop,
                print=None,
                access_log=None,
                shutdown_timeout=rc.shutdown_grace_s,
                handler_cancellation=True,
            )
        except OSError as e:
            raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}") from None
        finally:
            if share is not None:
                share.stop()
            tracing.shutdown()
        sys.exit(0)
    try:
        loop.run_until_complete(serve(router, host, port, ssl_context))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}") from None
    finally:
        if share is not None:
            share.stop()
        loop.close()
        tracing.shutdown()
    sys.exit(0)


def make_share(cfg, table: RoutingTable) -> Share:
    """The router's link to its peers for prefix routing (share.py), from
    `router.prefix_share` and `router.prefix_peers` ("NAME@ENDPOINT", each NAME a
    router registered with `llmgw routers add`, its public key read from the store)."""
    rc = cfg.router
    if table.prefix is None:
        raise click.ClickException(
            'router.prefix_share and router.prefix_peers need router.routing = "prefix"'
        )
    peers = {}
    for text in rc.prefix_peers:
        name, sep, endpoint = text.partition("@")
        if not sep or not name or not endpoint.startswith(("tcp://", "ipc://")):
            raise click.ClickException(
                f"router.prefix_peers: {text!r}: want NAME@ENDPOINT, e.g. router-b@tcp://10.0.0.2:7075"
            )
        try:
            peer = BusPeer.get_or_none((BusPeer.name == name) & (BusPeer.kind == "router"))
        except peewee.PeeweeException as e:
            raise click.ClickException(
                f"router.prefix_peers: cannot read the registered routers: {str(e)[:200]}"
            ) from None
        if peer is None:
            raise click.ClickException(
                f"router.prefix_peers: {name} is not a registered router"
                f" (`llmgw routers add {name}`)"
            )
        peers[name] = (endpoint, peer.public_key)
    try:
        keys = bus.load_keypair(cfg.curve_dir(), rc.bus_name, "routers")
    except Error as e:
        raise click.ClickException(f"router.prefix_share: {e}") from None

    def lookup(public_key: str) -> str | None:
        """A subscriber's name, if it is a registered router (on the ZAP thread)."""
        return name_of(public_key, _log, kind="router")

    return Share(rc.bus_name, rc.prefix_share, peers, keys, table.prefix.inbox, lookup=lookup,
                 loads=table.prefix.loads, on_count=metrics.prefix_shared)  # fmt: skip


async def serve(router: Router, host: str, port: int, ssl_context) -> None:
    """Serve with the http1 transport until SIGTERM or SIGINT, then stop in order: stop
    listening, let requests under way end (router.shutdown_grace_s), flush usage."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = http1.Server(router.routes, router.state, router.rc)
    await router.start()
    try:
        await server.listen(host, port, ssl=ssl_context)
    except OSError:
        await router.stop()
        raise
    metrics.CONNECTIONS.set_function(lambda: len(server.conns))
    # What start-up made (modules, settings, tables) lives as long as the process: out
    # of the collector's sight, its full collections no longer walk it.
    gc.freeze()
    await stop.wait()
    _log.info("stopping", connections=len(server.conns))
    await server.close(router.rc.shutdown_grace_s)
    await router.stop()
