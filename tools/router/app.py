"""The router's aiohttp application: routes, background workers, orderly shutdown."""

import asyncio
import time

import prometheus_client
from aiohttp import web

from llmgw import log
from llmgw_router import dialects, metrics, models, probe, responses_api
from llmgw_router.admission import Admission
from llmgw_router.conversations import Conversations
from llmgw_router.errors import api_error
from llmgw_router.keycache import KeyCache
from llmgw_router.leases import Leaser
from llmgw_router.limits import Limiter
from llmgw_router.policy import Policies
from llmgw_router.proxy import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RERANK,
    RERANKING,
    Proxy,
    request_id,
)
from llmgw_router.quota import Quota
from llmgw_router.routing import RoutingTable
from llmgw_router.upstream import Pool
from llmgw_router.usage import UsageWriter

# How often queued requests are looked at again, for capacity that came back without
# a request ending (an endpoint out of cooldown).
_PUMP_S = 0.5

_log = log.get("llmgw.router")


def build(cfg, table: RoutingTable, db, feed=None, spool=None) -> web.Application:
    """The application; workers start with it and stop (flushing usage) with it."""
    rc = cfg.router
    keys = KeyCache(refresh_s=rc.key_refresh_s)
    usage = UsageWriter(
        db,
        capacity=rc.usage_buffer,
        batch=rc.usage_batch,
        flush_s=rc.usage_flush_s,
        on_drop=metrics.USAGE_DROPPED.inc,
        spool=spool,
    )
    limiter = Limiter()
    leaser = Leaser(limiter, db)
    policies = Policies(
        limiter,
        rc.bands,
        rc.default_band,
        models=cfg.models,
        extra_engines={e.name for e in cfg.agent.engines},
        refresh_s=rc.limits_refresh_s,
    )
    quota = Quota(limiter, leaser, rc.lease_wait_s, rc.default_max_tokens)
    admission = Admission(policies.bands, lambda model: capacity(table, policies, model, rc))
    prober = probe.Probe(table, rc.engine_probe_s)
    # aiohttp's own limit answers with plain text; ours answers in OpenAI's shape, so let
    # bodies through aiohttp up to one byte past the limit and judge them in the proxy.
    app = web.Application(client_max_size=rc.max_body_bytes + 1)
    app["keys"], app["usage"], app["table"] = keys, usage, table
    app["policies"], app["admission"] = policies, admission
    app["fed"] = feed is not None
    conversations = app["conversations"] = Conversations(db)

    async def on_startup(app):
        loop = asyncio.get_running_loop()
        keys.start(db)
        usage.start()
        conversations.start()
        policies.start(db)
        leaser.start(loop)

        def pump():
            admission.pump_all()
            app["pump"] = loop.call_later(_PUMP_S, pump)

        # The engines' word on their load may free slots: look at the queues again.
        prober.on_change = lambda: loop.call_soon_threadsafe(admission.pump_all)
        prober.start()

        app["pump"] = loop.call_later(_PUMP_S, pump)
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
            policies=policies,
            quota=quota,
            admission=admission,
            queue_deadline_s=rc.queue_deadline_s,
        )
        if feed is not None:
            feed.load = lambda: load_report(table, policies, admission, rc)

            def install(eps, known):
                table.replace(eps, known)
                pool.retain(ep.url for ep in eps)  # replicas that left: their connections go
                admission.pump_all()  # more replicas: more slots for the queued

            # The feed's thread hands each new table to the loop; the request path only
            # ever sees a whole table.
            feed.apply = lambda eps, known: loop.call_soon_threadsafe(install, eps, known)
            feed.start()
        metrics.KEYS_LOADED.set_function(lambda: len(keys))
        metrics.USAGE_PENDING.set_function(usage.pending)

    async def on_cleanup(app):
        app["pump"].cancel()
        prober.stop()
        if feed is not None:
            feed.stop()
        app["pool"].close()
        keys.stop()
        policies.stop()
        # Give back unused allowance and concurrency slots, so the other routers can
        # have them now rather than when the window ends or the hold expires.
        await asyncio.get_running_loop().run_in_executor(None, leaser.stop)
        # Flush in a thread: the store may be slow, and the loop is still ours.
        await asyncio.get_running_loop().run_in_executor(None, conversations.stop)
        await asyncio.get_running_loop().run_in_executor(None, usage.stop)
        _log.info("stopped", usage_rows_written=usage.written, usage_rows_replayed=usage.replayed)

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
    app.router.add_post(RERANK.path, via_proxy("forward", RERANK))
    app.router.add_post(RERANKING.path, via_proxy("forward", RERANKING))
    for route in dialects.ROUTES:
        app.router.add_post(route.path, dialects.handler(route))
    app.router.add_get("/v1/responses/{response_id}", responses_api.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", responses_api.delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", responses_api.input_items)
    app.router.add_get("/v1/models", via_proxy("models"))
    app.router.add_get("/v1/models/{model}", models.retrieve)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


def capacity(table: RoutingTable, policies: Policies, model: str, rc) -> int | None:
    """Requests `model` can take at once (None: unknown, so never saturated)."""
    info = policies.model(model)
    slots = info.parallel if info is not None else rc.slots_per_replica
    return probe.capacity(table.endpoints_of(model), slots, time.monotonic(), time.time())


def load_report(table: RoutingTable, policies: Policies, admission: Admission, rc) -> dict:
    """What the scheduler's autoscaler hears from this router with each activity report:
    in flight and slots per replica, and each model's queue wait p90."""

    def slots_of(ep) -> int:
        info = policies.model(ep.models[0])
        return info.parallel if info is not None else rc.slots_per_replica

    return {
        "replica_load": probe.replica_load(table.endpoints(), slots_of, time.time()),
        "queue_wait_p90_s": admission.wait_p90(time.monotonic()),
    }


def not_ready_because(app: web.Application) -> str:
    """Why this router cannot answer requests yet ("" once it can): what readiness says."""
    table = app["table"]
    if not app["keys"].loaded.is_set():
        return "API keys are not loaded yet (is the store reachable?)"
    if not app["policies"].loaded.is_set():
        return "limits and budgets are not loaded yet (is the store reachable?)"
    if not table.has_table:
        return "no routing table from the schedulers yet"
    if not table.endpoints() and not app["fed"]:
        return "no endpoints configured: give --endpoint, [[router.endpoints]] or router.schedulers"
    return ""


def _state(request: web.Request) -> tuple[str, dict]:
    app, table = request.app, request.app["table"]
    why = not_ready_because(app)
    return why, {
        "status": "ok" if not why else "starting",
        "ready": not why,
        "reason": why or None,
        "keys_loaded": app["keys"].loaded.is_set(),
        "limits_loaded": app["policies"].loaded.is_set(),
        "routing_table": table.has_table,
        "models": table.models(),
        "usage_rows_pending": app["usage"].pending(),
    }


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the process answers at all, with what readiness would say.
    Restart a router on this failing, never route by it."""
    _, body = _state(request)
    return web.json_response(body)


async def ready(request: web.Request) -> web.Response:
    """Readiness, what a load balancer probes: 200 once keys, limits and a routing table
    are loaded; until then 503 with the reason (and after the table arrives, a model
    that is not served is not there, rather than not yet known)."""
    why, body = _state(request)
    return web.json_response(body, status=503 if why else 200)


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
