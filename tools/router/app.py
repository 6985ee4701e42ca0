"""The router: its parts, their workers and orderly shutdown, and which handler answers
which request. Served by http1.py (or aiohttp_app.py); knows neither."""

import asyncio
import functools
import time

import prometheus_client

from llmgw import log
from llmgw_router import dialects, metrics, models, probe, responses_api
from llmgw_router.admission import Admission
from llmgw_router.conversations import Conversations
from llmgw_router.errors import api_error
from llmgw_router.exchange import Answer, json_answer
from llmgw_router.keycache import KeyCache
from llmgw_router.leases import Leaser
from llmgw_router.limits import Limiter
from llmgw_router.policy import Policies
from llmgw_router.proxy import Proxy, request_id
from llmgw_router.quota import Quota
from llmgw_router.routes import CHAT, COMPLETIONS, EMBEDDINGS, RERANK, RERANKING
from llmgw_router.routing import RoutingTable
from llmgw_router.upstream import Pool
from llmgw_router.usage import UsageWriter

# How often queued requests are looked at again, for capacity that came back without
# a request ending (an endpoint out of cooldown).
_PUMP_S = 0.5

_log = log.get("llmgw.router")


class Router:
    """The router's parts and their lifecycle, whatever serves HTTP: `state` is what
    every request sees as `request.app`; `routes` maps requests to handlers."""

    def __init__(self, cfg, table: RoutingTable, db, feed=None, spool=None):
        rc = self.rc = cfg.router
        self.table, self.db, self.feed = table, db, feed
        self.keys = keys = KeyCache(refresh_s=rc.key_refresh_s)
        self.usage = UsageWriter(
            db,
            capacity=rc.usage_buffer,
            batch=rc.usage_batch,
            flush_s=rc.usage_flush_s,
            on_drop=metrics.USAGE_DROPPED.inc,
            spool=spool,
            nice=rc.usage_writer_nice,
        )
        self.leaser = Leaser(Limiter(), db)
        limiter = self.leaser.limiter
        self.policies = policies = Policies(
            limiter,
            rc.bands,
            rc.default_band,
            models=cfg.models,
            extra_engines={e.name for e in cfg.agent.engines},
            refresh_s=rc.limits_refresh_s,
        )
        quota = Quota(limiter, self.leaser, rc.lease_wait_s, rc.default_max_tokens)
        self.admission = Admission(
            policies.bands, lambda model: capacity(table, policies, model, rc)
        )
        self.prober = probe.Probe(table, rc.engine_probe_s)
        self.pool = Pool(
            connect_timeout=rc.connect_timeout_s,
            total_timeout=rc.upstream_timeout_s,
            max_conns=rc.max_engine_connections,
            dead_s=rc.dead_engine_s,
        )
        self.conversations = Conversations(db, chain_max=rc.responses_chain_max)
        self.proxy = Proxy(
            table,
            keys,
            self.usage,
            self.pool,
            rc.max_body_bytes,
            rc.retries,
            rc.keepalive_interval_s,
            activation_s=rc.activation_window_s,
            feed=feed,
            policies=policies,
            quota=quota,
            admission=self.admission,
            queue_deadline_s=rc.queue_deadline_s,
        )
        self.state = {
            "keys": keys,
            "usage": self.usage,
            "table": table,
            "policies": policies,
            "admission": self.admission,
            "fed": feed is not None,
            "conversations": self.conversations,
            "proxy": self.proxy,
        }
        self.routes = Routes(not_found)
        self._pump = None
        for route in (CHAT, COMPLETIONS, EMBEDDINGS, RERANK, RERANKING):
            self.routes.add("POST", route.path, functools.partial(self.proxy.forward, route=route))
        for route in dialects.ROUTES:
            self.routes.add("POST", route.path, dialects.handler(route))
        self.routes.add("GET", "/v1/responses/{response_id}", responses_api.retrieve)
        self.routes.add("DELETE", "/v1/responses/{response_id}", responses_api.delete)
        self.routes.add("GET", "/v1/responses/{response_id}/input_items", responses_api.input_items)
        self.routes.add("GET", "/v1/models", self.proxy.models)
        self.routes.add("GET", "/v1/models/{model}", models.retrieve)
        self.routes.add("GET", "/health", health)
        self.routes.add("GET", "/ready", ready)
        self.routes.add("GET", "/metrics", metrics_page)

    async def start(self) -> None:
        """Start the workers, on the running loop."""
        loop = asyncio.get_running_loop()
        table, admission, feed = self.table, self.admission, self.feed
        self.keys.start(self.db)
        self.usage.start()
        self.conversations.start()
        self.policies.start(self.db)
        self.leaser.start(loop)

        def pump():
            admission.pump_all()
            self._pump = loop.call_later(_PUMP_S, pump)

        # The engines' word on their load may free slots: look at the queues again.
        self.prober.on_change = lambda: loop.call_soon_threadsafe(admission.pump_all)
        self.prober.start()
        self._pump = loop.call_later(_PUMP_S, pump)
        if feed is not None:
            feed.load = lambda: load_report(table, self.policies, admission, self.rc)

            def install(eps, known):
                table.replace(eps, known)
                self.pool.retain(ep.url for ep in eps)  # replicas that left: their connections go
                admission.pump_all()  # more replicas: more slots for the queued

            # The feed's thread hands each new table to the loop; the request path only
            # ever sees a whole table.
            feed.apply = lambda eps, known: loop.call_soon_threadsafe(install, eps, known)
            # Requests waiting for a model look again: none can be started now.
            feed.on_cut_off = lambda: loop.call_soon_threadsafe(table.wake_waiters)
            metrics.TABLE_AGE.set_function(feed.silent_s)
            feed.start()
        metrics.KEYS_LOADED.set_function(lambda: len(self.keys))
        metrics.USAGE_PENDING.set_function(self.usage.pending)

    async def stop(self) -> None:
        """Stop the workers, flushing usage; after the last request has ended."""
        if self._pump is not None:
            self._pump.cancel()
        self.prober.stop()
        if self.feed is not None:
            self.feed.stop()
        self.pool.close()
        self.keys.stop()
        self.policies.stop()
        loop = asyncio.get_running_loop()
        # Give back unused allowance and concurrency slots, so the other routers can
        # have them now rather than when the window ends or the hold expires.
        await loop.run_in_executor(None, self.leaser.stop)
        # Flush in a thread: the store may be slow, and the loop is still ours.
        await loop.run_in_executor(None, self.conversations.stop)
        await loop.run_in_executor(None, self.usage.stop)
        _log.info(
            "stopped",
            usage_rows_written=self.usage.written,
            usage_rows_replayed=self.usage.replayed,
        )


class Routes:
    """(method, path) to handler: exact paths in a dict, the few with a named part
    (`/v1/models/{model}`) matched segment by segment."""

    def __init__(self, fallback):
        self.fallback = fallback  # unknown paths and methods
        self.exact: dict[tuple[str, str], object] = {}
        self.patterns: list[tuple[str, tuple[str, ...], object]] = []

    def add(self, method: str, path: str, handler) -> None:
        if "{" not in path:
            self.exact[(method, path)] = handler
        else:
            self.patterns.append((method, tuple(path.strip("/").split("/")), handler))

    def resolve(self, method: str, path: str) -> tuple[object, dict]:
        """(handler, the path's named parts); HEAD is answered as GET."""
        if method == "HEAD":
            method = "GET"
        handler = self.exact.get((method, path))
        if handler is not None:
            return handler, {}
        parts = path.strip("/").split("/")
        for m, pattern, handler in self.patterns:
            if m != method or len(pattern) != len(parts):
                continue
            info = {}
            for want, got in zip(pattern, parts, strict=True):
                if want.startswith("{"):
                    if not got:
                        break
                    info[want[1:-1]] = got
                elif want != got:
                    break
            else:
                return handler, info
        return self.fallback, {}


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


def not_ready_because(app: dict) -> str:
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


def _state(request) -> tuple[str, dict]:
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
        **control_plane(app),
    }


def control_plane(app: dict) -> dict:
    """How long since a scheduler last sent a table. A router cut off from them stays
    ready: it serves its last table, and answers a model it cannot start at once."""
    feed = app["proxy"].feed
    if feed is None:
        return {}
    return {
        "control_plane": {
            "reachable": not feed.cut_off(),
            "table_age_s": round(feed.silent_s(), 1),
        }
    }


async def health(request) -> Answer:
    """Liveness: 200 while the process answers at all, with what readiness would say.
    Restart a router on this failing, never route by it."""
    _, body = _state(request)
    return json_answer(body)


async def ready(request) -> Answer:
    """Readiness, what a load balancer probes: 200 once keys, limits and a routing table
    are loaded; until then 503 with the reason (and after the table arrives, a model
    that is not served is not there, rather than not yet known)."""
    why, body = _state(request)
    return json_answer(body, 503 if why else 200)


async def metrics_page(request) -> Answer:
    data = prometheus_client.generate_latest()
    return Answer(200, data, {"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


async def not_found(request) -> Answer:
    rid = request_id(request)
    return api_error(
        404,
        f"No such endpoint: {request.method} {request.path}",
        "invalid_request_error",
        "unknown_url",
        rid,
    )
