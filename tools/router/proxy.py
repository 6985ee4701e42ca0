"""The request path: parse, authorise, reserve against limits, admit by band, choose
a model (falling back when one cannot answer), forward, account.

Everything a request touches lives here and in the in-memory structures it is given
(routing table, key cache, policies and limits, admission queues, usage buffer), so
the transport can be swapped without touching the rest. Nothing here waits on the
store; a request whose limits need more allowance waits (up to router.lease_wait_s)
for the lease thread, which does.
"""

import asyncio
import functools
import itertools
import json
import secrets
import time

from llmgw import log, tracing
from llmgw.states import ModelState
from llmgw_router import metrics, routes, traces
from llmgw_router.admission import Admission
from llmgw_router.api import OPENAI
from llmgw_router.call import CLIENT_CLOSED, Call, Upstreams
from llmgw_router.errors import ApiError, api_error
from llmgw_router.exchange import Answer, Stream, json_answer
from llmgw_router.keycache import KeyCache
from llmgw_router.limits import COST_KINDS, Reservation
from llmgw_router.policy import Policies
from llmgw_router.quota import Quota
from llmgw_router.routes import Route
from llmgw_router.routing import RoutingTable
from llmgw_router.splice import ask_usage
from llmgw_router.upstream import Pool
from llmgw_router.usage import UsageRow, UsageWriter

_log = log.get("llmgw.router")

# The most a request waits for a starting router's first table (it comes within the
# schedulers' snapshot interval, 3 s, of connecting).
_TABLE_WAIT_S = 5.0


class Proxy:
    def __init__(
        self,
        table: RoutingTable,
        keys: KeyCache,
        usage: UsageWriter,
        pool: Pool,
        max_body_bytes: int,
        retries: int,
        keepalive_interval_s: float,
        *,
        policies: Policies,
        quota: Quota,
        admission: Admission,
        activation_s: float = 0.0,
        feed=None,
        queue_deadline_s: float = 30.0,
    ):
        self.table = table
        self.keys = keys
        self.usage = usage
        self.pool = pool
        self.max_body = max_body_bytes
        self.activation_s = activation_s
        self.feed = feed  # the scheduler feed: wants and activity go through it
        self.policies = policies
        self.quota = quota
        self.admission = admission
        self.queue_deadline_s = queue_deadline_s
        # A starting router holds a request this long for its first routing table, so
        # one sent just after a restart is answered rather than told to come back.
        self.table_wait_s = min(activation_s, _TABLE_WAIT_S)
        self.up = Upstreams(table, pool, policies, retries, keepalive_interval_s)
        # Requests with an engine now: a plain count the in-flight gauge reads when
        # scraped, rather than two locked gauge updates on every request.
        self.in_flight = 0
        metrics.IN_FLIGHT.set_function(lambda: self.in_flight)

    # -- authorisation ---------------------------------------------------------------

    def authorise(self, request):
        """The caller's Key; ApiError (401, or 503 before keys are loaded) if none."""
        if not self.keys.loaded.is_set() or not self.policies.loaded.is_set():
            raise ApiError(
                503,
                "API keys and limits are not loaded yet (is the store reachable?)",
                "server_error",
                "keys_not_loaded",
                retry_after=2,
            )
        auth = request.headers.get("Authorization", "")
        # Anthropic's clients send the key as x-api-key; either header will do.
        secret = auth[7:].strip() if auth.startswith("Bearer ") else ""
        secret = secret or request.headers.get("x-api-key", "").strip()
        if not secret:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                           "invalid_request_error", "invalid_api_key")  # fmt: skip
        key = self.keys.lookup(secret)
        if key is None or (key.expires_at is not None and key.expires_at <= time.time()):
            raise ApiError(401, "Invalid, revoked or expired API key.",
                           "invalid_request_error", "invalid_api_key")  # fmt: skip
        return key

    # -- handlers --------------------------------------------------------------------

    async def caller(self, request):
        """The caller's Key, once the routing table is in (what a listing needs);
        ApiError if there is none or the table does not come."""
        key = self.authorise(request)
        if not self.table.has_table and not await self.table.wait_table(self.table_wait_s):
            raise no_table()
        return key

    async def models(self, request) -> Answer:
        rid = request_id(request)
        key = await self.caller(request)  # ApiError: answered by the transport
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llmgw"}
            for m in self.table.models()
            if key.allows(m)
        ]
        return json_answer({"object": "list", "data": data}, headers={"x-request-id": rid})

    async def forward(self, request, route: Route) -> Answer | Stream:
        t0 = time.perf_counter()
        rid = request_id(request)
        # The request's span while tracing is on (traces.py); None, and nothing made, if off.
        span = None if tracing.tracer is None else traces.request_span(request, route, rid)
        try:
            key = self.authorise(request)
        except ApiError as e:
            resp = count(e.answer(rid), "", route.path)
            if span is not None:
                traces.refused(span, route.path, rid, resp.status)
            return resp
        policy = self.policies.policy(key)
        ticket = Ticket(rid, key.id, policy.who, t0, route.path)
        if span is not None:
            ticket.span = span
            ticket.traced = span if span.is_recording() else None
        try:
            payload, body, reservation = await self.admit(request, route, ticket, key, policy)
        except ApiError as e:
            resp = self.reject(e.answer(rid), ticket, ticket.model)
            if span is not None:
                span.end()
            return resp
        if ticket.traced is not None:
            traces.asked(ticket.traced, payload)
        stream = payload.get("stream") is True
        try:
            return await self.answer(request, route, ticket, policy, key, payload, body, stream,
                                     reservation)  # fmt: skip
        except asyncio.CancelledError:
            # The client went away and the transport cancelled the handler. Leaving here
            # closes the upstream response, so the engine frees its slot.
            ticket.status = CLIENT_CLOSED
            raise
        except ConnectionError:
            # The client went away while we wrote to it. Raised on, the transport would
            # log a traceback after our client_disconnected; handing back the stream it
            # already has lets it see the closed connection itself, quietly.
            ticket.status = CLIENT_CLOSED
            call = ticket.call
            return (
                call.resp if call is not None and call.resp is not None else Answer(CLIENT_CLOSED)
            )
        finally:
            self.account(ticket, reservation)
            if span is not None:
                span.end()

    async def admit(self, request, route: Route, ticket: "Ticket", key, policy):
        """(payload, the bytes the engine gets, the reservation or None) for a request
        its key may make, within its limits; ApiError if not."""
        payload, body = await self.parse(request, route)
        model = ticket.model = payload["model"]
        if not key.allows(model):
            raise ApiError(403, f"This API key may not use model '{model}'.",
                           "permission_error", "model_not_allowed", param="model")  # fmt: skip
        if route.prepare is not None:
            ticket.on_answer = await route.prepare(request, key, payload)
            body = None
        if not self.table.has_table and not await self.table.wait_table(self.table_wait_s):
            raise no_table()

        if payload.get("stream") is True and route.api is OPENAI:
            opts = payload.get("stream_options") or {}
            ticket.client_usage = bool(opts.get("include_usage"))
            if not ticket.client_usage:
                # Always ask for usage: it is what the usage row and budgets count.
                if body is not None and "stream_options" not in payload:
                    # The openai client's default: spliced in, not serialised again.
                    body = ask_usage(body)
                payload["stream_options"] = {**opts, "include_usage": True}

        reservation = None
        if policy.limited:
            max_tokens = 0
            if route.max_tokens_field and (policy.tokens or policy.costs):
                max_tokens = payload.get(route.max_tokens_field) or payload.get(
                    "max_completion_tokens"
                )
                if (
                    not isinstance(max_tokens, int)
                    or isinstance(max_tokens, bool)
                    or max_tokens <= 0
                ):
                    # Nothing would bound the answer, nor what it spends: bound it.
                    max_tokens = self.quota.default_max_tokens
                    payload[route.max_tokens_field] = max_tokens
                    body = None
            info = self.policies.model(model)
            prices = (info.input_per_mtok, info.output_per_mtok) if info else None
            if policy.costs and not priced(prices):
                raise unpriced(model, policy.costs[0])
            if body is None:  # serialised once, here: the engine gets these bytes
                body = json.dumps(payload).encode()
            body_len = len(body)
            ask = self.quota.ask(policy, body_len, max_tokens, prices)
            got = self.quota.try_reserve(ask)  # the usual case: no waiting at all
            if not isinstance(got, Reservation):
                got = await self.quota.reserve(ask, got)
            ticket.headers = self.quota.headers(policy)
            if not isinstance(got, Reservation):
                raise self.quota.refusal(got, ticket.headers)
            reservation = ticket.reservation = got
            ticket.grade = (ask, body_len, prices)
        if body is None:
            body = json.dumps(payload).encode()
        return payload, body, reservation

    # -- choosing the model that answers -------------------------------------------------

    def candidates(self, model: str, key) -> list[str]:
        """The model asked for, then its fallbacks the key may use."""
        info = self.policies.model(model)
        if info is None or not info.fallbacks:
            return [model]
        return [model, *(f for f in info.fallbacks if key.allows(f) and f != model)]

    async def answer(self, request, route, ticket, policy, key, payload, body, stream,
                     reservation=None):  # fmt: skip
        """Try the model, then each fallback, until one answers; the response."""
        names = self.candidates(ticket.model, key)
        band = policy.band
        # Where the prompt is cached (router.routing = "prefix"); None otherwise.
        affinity = self.table.key(payload, request.headers.get("x-llmgw-session", ""))
        deadline = None
        err = None
        for i, name in enumerate(names):
            first, last = i == 0, i == len(names) - 1
            if self.feed is not None:
                self.feed.used(name, time.time())
            if not self.table.serves(name):
                known = self.table.knows(name) or (self.policies.model(name) is not None)
                if first and not known:
                    err = ticket.fail(api_error(
                        404, f"The model '{name}' does not exist.", "invalid_request_error",
                        "model_not_found", ticket.rid, param="model"))  # fmt: skip
                    break
                if not (first and await self.activate(name, hurry=not last)):
                    if first:
                        err = ticket.fail(self.not_ready(name, ticket.rid))
                    elif self.feed is not None:
                        self.feed.want(name)  # for later requests; this one goes on
                    self._fell_back(ticket.model, names, i, "unservable")
                    continue
            if not first and reservation is not None and not await self._regrade(ticket, name):
                self._fell_back(ticket.model, names, i, "budget")
                continue
            if deadline is None:
                deadline = time.monotonic() + self.queue_deadline_s
            wait = deadline - time.monotonic() if last or first else 0.0
            # enter_now first: the usual case, a free slot, needs no coroutine.
            admitted = self.admission.enter_now(name)
            if not admitted:
                t = ticket.traced
                queue = t and traces.admission(t, name, self.admission, band)
                admitted = await self.admission.enter(name, band, wait)
                if queue is not None:
                    traces.admitted(queue, admitted)
            if not admitted:
                err = err if err is not None else ticket.fail(saturated(name, ticket.rid))
                self._fell_back(ticket.model, names, i, "saturated")
                continue
            try:
                call = Call(self.up, request, route, ticket.rid, name, stream, ticket.client_usage,
                            ticket.t0, ticket.headers)  # fmt: skip
                ticket.call = call
                call.trace = ticket.span
                call.affinity = affinity
                call.before_done = functools.partial(self._stream_done, ticket, call)
                call.on_answer = ticket.on_answer
                asked = self.served_name(name)  # an alias's engine knows its model's name
                if asked != payload["model"]:
                    body = json.dumps({**payload, "model": asked}).encode()
                self.in_flight += 1
                try:
                    resp = await call.run(body)
                finally:
                    self.in_flight -= 1
                ticket.status = call.status
            finally:
                self.admission.leave(name)
            if call.failed_early and not last:
                self._fell_back(ticket.model, names, i, "failed")
                err = err if err is not None else resp
                continue
            return resp
        if err is None:
            err = ticket.fail(api_error(
                503, f"No model could answer for '{ticket.model}'.", "server_error",
                "model_unavailable", ticket.rid, retry_after=5))  # fmt: skip
        ticket.status = err.status
        for k, v in ticket.headers.items():
            err.headers[k] = v
        return err

    async def _regrade(self, ticket: "Ticket", name: str) -> bool:
        """A fallback at higher prices must fit the cost budgets too."""
        ask, body_len, prices = ticket.grade
        info = self.policies.model(name)
        new = (info.input_per_mtok, info.output_per_mtok) if info else None
        if not priced(new) and any(c.kind in COST_KINDS for c, *_ in ticket.reservation.takes):
            return False  # a cost budget could not count what it costs: never at 0
        covered = await self.quota.regrade(ticket.reservation, ask, body_len, prices, new)
        if covered is None and new is not None:
            return False
        ticket.grade = (ask, body_len, covered)
        return True

    def served_name(self, model: str) -> str:
        return self.up.served_name(model)

    def _fell_back(self, model: str, names: list, i: int, reason: str) -> None:
        if i + 1 < len(names):
            metrics.FALLBACKS.labels(model, names[i + 1], reason).inc()

    async def activate(self, model: str, hurry: bool = False) -> bool:
        """Ask the scheduler for a model that has no ready replica and hold the request
        up to the activation window while it comes up. Each request asks afresh and
        waits for the answer to its own want only: an earlier "unplaceable" may be stale
        (room may have been made since), and a fresh one ends the wait at once rather
        than after the whole window. A parked model is answered at once (so is any, with
        `hurry`, when a fallback may answer sooner than a model that is still starting),
        and so is every model while the schedulers are silent (`cut_off`): none of them
        can start it. The want is sent all the same: it is delivered if the link heals."""
        n = self.feed.want(model) if self.feed is not None else 0
        state, _ = self.table.status(model) or (ModelState.STARTING, "")
        if state == "parked" or self.activation_s <= 0 or hurry or (state, n) == ("unplaceable", 0):
            return False
        if self.cut_off():
            return False

        def refused() -> bool:  # our own want answered and the answer is no, or cut off
            if self.cut_off():
                return True
            answer = self.table.status(model) or (ModelState.STARTING, "")
            return n and self.feed.answered(model) >= n and answer[0] in ("parked", "unplaceable")

        return await self.table.wait_served(model, self.activation_s, refused)

    def cut_off(self) -> bool:
        """Whether this router has heard no scheduler for so long that it cannot have a
        model started (feed.SILENCE_S); never without a feed."""
        return self.feed is not None and self.feed.cut_off()

    def not_ready(self, model: str, rid: str) -> Answer:
        """A catalog model with no ready replica: wait for one that is coming, or hear at
        once why one will not come."""
        if self.cut_off():
            silent = int(self.feed.silent_s())
            metrics.CONTROL_PLANE_UNREACHABLE.labels(model).inc()
            return api_error(
                503,
                f"The model '{model}' has no ready replica, and this router has not heard"
                f" from the schedulers for {silent}s, so it cannot start one; models with"
                " ready replicas are still served.",
                "server_error",
                "control_plane_unreachable",
                rid,
                retry_after=10,
            )
        state, reason = self.table.status(model) or (ModelState.STARTING, "")
        if state in ("parked", "unplaceable"):
            why = reason.strip().splitlines()[-1] if reason.strip() else "no reason given"
            return api_error(
                503,
                f"The model '{model}' cannot be served ({state}): {why}",
                "server_error",
                f"model_{state}",
                rid,
                retry=False,
            )
        return api_error(
            503,
            f"The model '{model}' has no ready replica yet; it is being started.",
            "server_error",
            "model_not_ready",
            rid,
            retry_after=5,
        )

    # -- accounting ----------------------------------------------------------------------

    def reject(self, resp: Answer, ticket: "Ticket", model: str) -> Answer:
        """Answer an authenticated request that never reached an engine, and account it."""
        ticket.fail(resp)
        ticket.model = model
        self.account(ticket, None)
        return resp

    def _stream_done(self, ticket: "Ticket", call: Call) -> None:
        """A stream is about to send its [DONE]: account it now (see Call.before_done)."""
        ticket.status = call.status
        self.account(ticket, ticket.reservation)

    def account(self, ticket: "Ticket", reservation) -> None:
        """Metrics, the reservation's correction and the usage row. Runs once a request."""
        if ticket.accounted:
            return
        ticket.accounted = True
        now = time.perf_counter()
        latency = now - ticket.t0
        call = ticket.call
        requested = ticket.model[:200]
        served = call.model if call is not None else None
        prompt = completion = 0
        cached = ttft = None
        if call is not None and call.route.bills:
            prompt, cached = call.meter.prompt_counts()
            # A stream cut short has no usage chunk: it counts its content events.
            completion = call.meter.completion
            if call.t_first is not None:
                ttft = call.t_first - ticket.t0
        status = ticket.status
        cost = None
        info = self.policies.model(served) if served else None
        prices = (info.input_per_mtok, info.output_per_mtok) if info else None
        if reservation is not None:
            units = self.quota.settle(reservation, prompt, completion, prices)
            cost = units / 1e6 if prices else None
        elif prices:
            cost = info.cost(prompt, completion)
        label = (
            served if served is not None else (requested if self.table.serves(requested) else "")
        )
        metrics.requests(label, status).inc()
        metrics.api_requests(ticket.api or "", status).inc()
        if call is not None:
            of_model = metrics.of_model(served)
            of_model.duration.observe(latency)
            if ttft is not None:
                of_model.ttft.observe(ttft)
            if prompt:
                of_model.prompt_tokens.inc(prompt)
            if completion:
                of_model.completion_tokens.inc(completion)
            metrics.OVERHEAD.observe(call.overhead)
        ep = call.endpoint if call is not None else None
        if ticket.traced is not None:
            engine = (ep.engine if ep is not None else "") or (info.engine if info else "")
            path = ticket.api or ""
            traces.accounted(ticket.traced, traces.OPERATIONS.get(path, path), path, ticket.rid,
                             requested, served, engine, status, prompt, completion, cached,
                             ttft)  # fmt: skip
        who = ticket.who
        self.usage.record(
            UsageRow(
                time.time(),
                ticket.rid,
                ticket.key_id,
                requested,
                served_model=served if ep else None,
                endpoint=ep.id if ep else None,
                prompt_tokens=prompt,
                completion_tokens=completion,
                status=status,
                latency_ms=latency * 1000.0,
                ttft_ms=ttft * 1000.0 if ttft is not None else None,
                user=who.user,
                project=who.project,
                team=who.team,
                org=who.org,
                cost=cost,
                api=ticket.api,
                cached_tokens=cached,
            )
        )
        if status == CLIENT_CLOSED:
            _log.info(
                "client_disconnected",
                request_id=ticket.rid,
                model=served or requested,
                endpoint=ep.id if ep else None,
                completion_tokens=completion,
            )

    async def parse(self, request, route: Route):
        """(payload, raw body); ApiError (400, 413) for a body that is not one."""
        return await routes.read(request, route, self.max_body)


class Ticket:
    """One client request, across the models tried for it: what its usage row needs."""

    __slots__ = ("rid", "key_id", "who", "t0", "model", "status", "call", "headers",
                 "reservation", "grade", "accounted", "api", "client_usage",
                 "on_answer", "span", "traced")  # fmt: skip

    def __init__(self, rid: str, key_id: str, who, t0: float, api: str | None = None):
        self.rid, self.key_id, self.who, self.t0 = rid, key_id, who, t0
        self.api = api  # the path it came by, for its usage row
        self.model = ""
        self.status = CLIENT_CLOSED  # until we know better
        self.call: Call | None = None  # the last model tried
        self.headers: dict = {}
        self.reservation = None
        self.grade = None  # (ask, body length, prices) the reservation was made at
        self.accounted = False
        self.client_usage = True  # a stream's client asked for its usage chunk
        self.on_answer = None  # its route's hook on the answer (routes.Route.prepare)
        self.span = None  # its span while tracing is on (traces.py)
        self.traced = None  # the same, if the sampler chose it: only then are there children

    def fail(self, resp: Answer) -> Answer:
        self.status = resp.status
        return resp


# -- helpers -----------------------------------------------------------------------------


def no_table() -> ApiError:
    """Before the first routing table, no model can be said not to exist: come back."""
    return ApiError(
        503,
        "The router is starting: it has no routing table from the schedulers yet.",
        "server_error",
        "router_not_ready",
        retry_after=2,
    )


def saturated(model: str, rid: str) -> Answer:
    return api_error(
        503,
        f"Every replica of '{model}' is busy, and none came free in time.",
        "server_error",
        "model_saturated",
        rid,
        retry_after=5,
    )


def priced(prices) -> bool:
    """A model a cost budget can count: it has a price for its prompt or its answer."""
    return prices is not None and (prices[0] > 0 or prices[1] > 0)


def unpriced(model: str, counter) -> ApiError:
    """A cost budget applies and the model has no prices: its cost could not be counted,
    so the budget could be overspent without a trace. Refused, never admitted at 0."""
    kind, scope, subject = counter.name.split(":", 2)
    return ApiError(
        403,
        f"The model '{model}' has no prices ([models.pricing]), so the {kind} budget on"
        f" {scope} '{subject}' cannot count what it costs; set its prices to use it.",
        "permission_error",
        "model_not_priced",
        param="model",
    )


# Request ids this router makes: a random prefix per process and a counter (16 hex
# digits, as before), rather than reading the kernel's randomness for every request.
_RID_PREFIX = secrets.token_hex(4)
_rid_seq = itertools.count(1)


def new_request_id() -> str:
    return f"{_RID_PREFIX}{next(_rid_seq) & 0xFFFFFFFF:08x}"


def request_id(request) -> str:
    """The client's x-request-id if it is a sane one, else one of ours."""
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 64 and rid.isascii() and rid.isprintable():
        return rid
    return new_request_id()


def count(resp: Answer, model: str, api: str) -> Answer:
    """Count a request answered before it reached an engine."""
    metrics.requests(model, resp.status).inc()
    metrics.api_requests(api, resp.status).inc()
    return resp
