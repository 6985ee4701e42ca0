"""The router's aiohttp application: routes, background workers, orderly shutdown."""

import asyncio

import prometheus_client
from aiohttp import web

from llmgw import log
from llmgw_router import metrics
from llmgw_router.errors import api_error
from llmgw_router.keycache import KeyCache
from llmgw_router.proxy import CHAT, COMPLETIONS, EMBEDDINGS, Proxy, request_id
from llmgw_router.routing import RoutingTable
from llmgw_router.upstream import Pool
from llmgw_router.usage import UsageWriter

_log = log.get("llmgw.router")


def build(cfg, table: RoutingTable, db, feed=None) -> web.Application:
    """The application; workers start with it and stop (flushing usage) with it."""
    rc = cfg.router
    keys = KeyCache(refresh_s=rc.key_refresh_s)
    usage = UsageWriter(
        db,
        capacity=rc.usage_buffer,
        batch=rc.usage_batch,
        flush_s=rc.usage_flush_s,
        on_drop=metrics.USAGE_DROPPED.inc,
    )
    # aiohttp's own limit answers with plain text; ours answers in OpenAI's shape, so let
    # bodies through aiohttp up to one byte past the limit and judge them in the proxy.
    app = web.Application(client_max_size=rc.max_body_bytes + 1)
    app["keys"], app["usage"], app["table"] = keys, usage, table

    async def on_startup(app):
        keys.start(db)
        usage.start()
        pool = Pool(connect_timeout=rc.connect_timeout_s, total_timeout=rc.upstream_timeout_s)
        app["pool"] = pool
        app["proxy"] = Proxy(
            table,
            keys,
            usage,
            pool,
            rc.max_body_bytes,
            rc.retries,
            rc.keepalive_interval_s,
            activation_s=rc.activation_window_s,
            feed=feed,
        )
        if feed is not None:
            loop = asyncio.get_running_loop()
            # The feed's thread hands each new table to the loop; the request path only
            # ever sees a whole table.
            feed.apply = lambda eps, known: loop.call_soon_threadsafe(table.replace, eps, known)
            feed.start()
        metrics.KEYS_LOADED.set_function(lambda: len(keys))
        metrics.USAGE_PENDING.set_function(usage.pending)

    async def on_cleanup(app):
        if feed is not None:
            feed.stop()
        app["pool"].close()
        keys.stop()
        # Flush in a thread: the store may be slow, and the loop is still ours.
        await asyncio.get_running_loop().run_in_executor(None, usage.stop)
        _log.info("stopped", usage_rows_written=usage.written)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    def via_proxy(name, route=None):
        async def handle(request):
            proxy = request.app["proxy"]
            if route is None:
                return await getattr(proxy, name)(request)
            return await proxy.forward(request, route)

        return handle

    app.router.add_post(CHAT.path, via_proxy("forward", CHAT))
    app.router.add_post(COMPLETIONS.path, via_proxy("forward", COMPLETIONS))
    app.router.add_post(EMBEDDINGS.path, via_proxy("forward", EMBEDDINGS))
    app.router.add_get("/v1/models", via_proxy("models"))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


async def health(request: web.Request) -> web.Response:
    keys, table = request.app["keys"], request.app["table"]
    ready = keys.loaded.is_set()
    body = {
        "status": "ok" if ready else "starting",
        "keys_loaded": ready,
        "models": table.models(),
        "usage_rows_pending": request.app["usage"].pending(),
    }
    return web.json_response(body, status=200 if ready else 503)


async def metrics_page(request: web.Request) -> web.Response:
    data = prometheus_client.generate_latest()
    return web.Response(body=data, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


async def not_found(request: web.Request) -> web.Response:
    rid = request_id(request)
    return api_error(
        404,
        f"No such endpoint: {request.method} {request.path}",
        "invalid_request_error",
        "unknown_url",
        rid,
    )
