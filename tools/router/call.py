"""One attempt to answer a request with one model: choose an endpoint, forward, retry
on another before anything reached the client, stream back, read usage.

The Proxy (proxy.py) decides who may ask and which model answers (limits, admission,
fallbacks); a Call does the talking to engines, and leaves accounting to the Proxy.
"""

import asyncio
import json
import time

from llmgw import engines, log
from llmgw_router import metrics, prefix, tokens, traces
from llmgw_router.api import OPENAI
from llmgw_router.errors import ApiError, Untranslatable, api_error
from llmgw_router.exchange import Answer, Stream
from llmgw_router.meter import Meter
from llmgw_router.relay import Relay
from llmgw_router.routing import Endpoint
from llmgw_router.splice import model_field
from llmgw_router.upstream import UpstreamError

_log = log.get("llmgw.router")

# HTTP status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499

# Engine answers that mean "try another one": it is down, overloaded or still loading.
_RETRY_STATUSES = frozenset((502, 503, 504))


# An engine's answer on a path it does not serve at all (rather than a bad request).
_NO_SUCH_PATH = frozenset((404, 405, 501))
_CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\n"


class Upstreams:
    """What a Call needs of the router: the routing table, the engines' connections,
    the catalog (for names and engines) and the settings of talking to engines."""

    __slots__ = ("table", "pool", "policies", "retries", "keepalive_s", "lacking",
                 "local_logged_at")  # fmt: skip

    def __init__(self, table, pool, policies, retries: int, keepalive_s: float):
        self.table, self.pool, self.policies = table, pool, policies
        self.retries, self.keepalive_s = retries, keepalive_s
        # (endpoint url, path) pairs whose engine does not serve the path: those
        # requests go to it translated to chat completions (dialects.py).
        self.lacking: set[tuple[str, str]] = set()
        self.local_logged_at = float("-inf")  # router_out_of_resources: once a second

    def served_name(self, model: str) -> str:
        """The catalog's name for a model or alias (what engines are started as), or the
        name as given for one the catalog does not hold (static endpoints)."""
        info = self.policies.model(model)
        return info.name if info is not None else model


class Call(Relay):
    """One model's attempt at a request, from choosing an endpoint to the last byte (the
    client's side of it is the Relay's)."""

    __slots__ = ("up", "t0")

    def __init__(self, up: Upstreams, request, route, rid, model, stream, client_usage, t0,
                 headers):  # fmt: skip
        self.up = up
        self.request = request
        self.route = route
        self.rid = rid
        self.model = model  # the model this attempt asks: the one that answers, if it does
        # What every answer says in `model`: the served model's name, never the engine's
        # idea of it (llama-server says its weights' path unless given an alias).
        self.field = model_field(up.served_name(model))
        self.stream = stream
        self.client_usage = client_usage
        self.headers = headers  # sent with the answer, whatever it is (x-ratelimit-*)
        self.keepalive_s = up.keepalive_s
        self.t0 = t0
        self.t_first = None
        self.status = CLIENT_CLOSED  # until we know better
        self.endpoint: Endpoint | None = None
        self.meter = Meter()  # what the engine said this attempt cost (meter.py)
        self.overhead = 0.0
        self.resp: Stream | None = None  # set once headers went to the client
        # Whether the client has had anything an engine said (or an error), rather than
        # only keepalives: until it has, another endpoint may still answer.
        self._answered = False
        self._keepalive = None
        self._keepalive_task = None
        self._waiting_first = False
        # Called once, just before a stream's [DONE] goes to the client: the usage row is
        # spooled before the client has the whole answer, so a crash between the two
        # cannot leave a complete answer without its row.
        self.before_done = None
        self._broke = ""  # why the last attempt broke before the client had anything
        # Another API's request sent to an engine that lacks its path, as chat (dialects.py).
        self.translating = False
        self.translator = None  # the request as chat, and chat's answers back (dialects.py)
        self.on_answer = None  # what the whole answer passes before it is written (routes.py)
        self.affinity = None  # the prompt's prefix key, when routing by prefix (prefix.py)
        self._framer = None  # a stream's events as they come (sse.py)
        self._reader = None  # its API's reader: usage, content events, its end (meter.py)
        # The request's span while tracing is on (traces.py), and the attempt's if sampled.
        self.trace = None
        self.attempt = None

    # -- the attempt loop ------------------------------------------------------------

    async def run(self, body: bytes) -> Answer | Stream:
        up, table = self.up, self.up.table
        tried: list[Endpoint] = []
        last_reason = "no endpoint is available"
        self.meter.weigh = self.affinity is not None
        if self.stream:
            self._waiting_first = True
            self._arm_keepalive()
        self.overhead = time.perf_counter() - self.t0
        attempts = up.retries + 1
        try:
            while attempts > 0:
                attempts -= 1
                now = time.monotonic()
                ep = table.pick(self.model, now, tried, self.affinity)
                if ep is None:
                    break
                tried.append(ep)
                self.endpoint = ep
                try:
                    line, sent = self._translate(ep, body)
                except ApiError as e:
                    self.status = e.status
                    self._routed(ep)
                    return self._finish(e.answer(self.rid))
                sent = self._ask_progress(ep, sent)
                ep.outstanding += 1
                head = b"".join((line, ep.head, b"x-request-id: ", self.rid.encode(), b"\r\n"))
                if self.trace is not None:
                    head += self._traced(ep, len(tried))
                key = self.affinity
                if key is not None and key.holder is not None:
                    await self._hold(ep, key)
                try:
                    if key is not None:
                        key.sent_at = asyncio.get_running_loop().time()
                    upstream = await up.pool.request(up.pool.origin(ep.url), head, sent)
                except UpstreamError as e:
                    ep.outstanding -= 1
                    self._routed(ep)
                    if e.kind == "local" and self.resp is None:
                        self._attempt_done(None)
                        return self._out_of_resources(ep, e)
                    last_reason = self._upstream_failed(ep, e, e.kind)
                    self._attempt_done(None)
                    continue
                try:
                    if self._keepalive_task is not None:
                        await self._settle()
                    if self._lacks_path(ep, upstream.status):
                        await upstream.read()
                        tried.pop()  # the same endpoint again, in chat: not a failure
                        attempts += 1
                        continue
                    if upstream.status in _RETRY_STATUSES and not self._answered:
                        text = (await upstream.read())[:300].decode(errors="replace")
                        last_reason = self._upstream_failed(
                            ep, f"HTTP {upstream.status} {text}", kind=f"http_{upstream.status}"
                        )
                        continue
                    if self.stream and upstream.status == 200 and self.attempt is not None:
                        resp = await self._traced_stream(upstream)
                    elif self.stream and upstream.status == 200:
                        resp = await self._relay_stream(upstream)
                    else:
                        resp = await self._relay_whole(upstream)
                    if resp is not None:
                        return resp
                    # It broke before anything reached the client: another may answer.
                    last_reason = self._broke
                    self.meter.reset()
                    continue
                finally:
                    ep.outstanding -= 1
                    self._routed(ep)
                    self.meter.cached = self.meter.decode_weight = None
                    ep.last_used = time.monotonic()
                    upstream.release()
                    self._attempt_done(upstream.status)
            if self._keepalive_task is not None:
                await self._settle()
            return await self._give_up(tried, last_reason)
        finally:
            self._stop_keepalive()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()
            self._attempt_done(None)  # cancelled mid-attempt: its span ends all the same

    def _traced(self, ep: Endpoint, n: int) -> bytes:
        """Begin the attempt's span (if the request is sampled); the traceparent header
        line that makes the engine's work its child (or the request's, if not sampled)."""
        span = self.trace
        if span.is_recording():
            self.attempt = span = traces.attempt(span, ep, n)
        return traces.traceparent_line(span)

    def _attempt_done(self, status: int | None) -> None:
        if self.attempt is not None:
            traces.attempt_done(self.attempt, status)
            self.attempt = None

    async def _traced_stream(self, upstream) -> Answer | Stream | None:
        """The stream relayed, in a span of its own under the attempt's."""
        stream = traces.stream(self.attempt)
        try:
            return await self._relay_stream(upstream)
        finally:
            traces.stream_done(stream, self)

    async def _hold(self, ep: Endpoint, key) -> None:
        """Wait for the request evaluating this prompt on `ep` to end (prefix.hold)."""
        try:
            waited = await prefix.hold(key, self.up.table.prefix.hold_s)
        except BaseException:
            ep.outstanding -= 1
            self._routed(ep)
            raise
        metrics.prefix_held(self.model, waited)

    def _routed(self, ep: Endpoint) -> None:
        """Tell the prefix index the attempt on `ep` ended, and what the engine cached."""
        if self.affinity is not None:
            out = self.up.table.served(
                ep,
                self.affinity,
                self.meter.prompt_tokens,
                self.meter.cached,
                self.meter.decode_weight,
            )
            metrics.prefix_observed(self.model, out, self.meter.prompt_tokens)

    def _translate(self, ep: Endpoint, body: bytes) -> tuple[bytes, bytes]:
        """(request line, body) for this endpoint: as asked, or translated to chat for an
        engine known not to serve the path; ApiError (400) naming a field chat cannot
        carry."""
        api = self.route.api
        if api.translate is None:
            return self.route.head, body
        self.translating = (ep.url, self.route.path) in self.up.lacking
        if not self.translating and api.native:
            info = self.up.policies.model(self.model)
            self.translating = info is not None and not engines.serves(info.engine, api.native)
        if not self.translating:
            return self.route.head, body
        try:
            self.translator = api.translate(json.loads(body), self.up.served_name(self.model))
        except Untranslatable as e:
            raise ApiError(
                400,
                f"'{e.field}' cannot be carried: this model's engine does not serve"
                f" {self.route.path}, and its request is translated to chat completions,"
                " which have no such field.",
                "invalid_request_error",
                "unsupported_parameter",
                param=e.field,
            ) from None
        return _CHAT_HEAD, json.dumps(self.translator.chat).encode()

    def _lacks_path(self, ep: Endpoint, status: int) -> bool:
        """A native request the engine answered as a path it does not have: remember it,
        so this and later requests go to it translated."""
        if status not in _NO_SUCH_PATH or self.route.api.translate is None or self.translating:
            return False
        if self._answered:
            return False
        self.up.lacking.add((ep.url, self.route.path))
        _log.info("engine_lacks_path", endpoint=ep.id, path=self.route.path, status=status)
        return True

    def _upstream_failed(self, ep: Endpoint, err, kind: str) -> str:
        reason = str(err) or type(err).__name__
        metrics.UPSTREAM_ERRORS.labels(ep.id, kind).inc()
        if self.attempt is not None:
            traces.failed(self.attempt, kind, reason)
        self.up.table.failed(ep, time.monotonic())
        _log.warning(
            "upstream_failed",
            request_id=self.rid,
            endpoint=ep.id,
            model=self.model,
            kind=kind,
            reason=reason[:200],
        )
        return f"endpoint {ep.id}: {reason[:200]}"

    def _out_of_resources(self, ep: Endpoint, err: UpstreamError) -> Answer:
        """This router could not open a connection for want of its own resources: 503,
        and the engine stays in the table (putting it in cooldown for our fault made
        every request fail for cooldown_s). Logged at most once a second."""
        metrics.UPSTREAM_ERRORS.labels(ep.id, "local").inc()
        now = time.monotonic()
        if now - self.up.local_logged_at >= 1.0:
            self.up.local_logged_at = now
            _log.error("router_out_of_resources", endpoint=ep.id, reason=str(err)[:200],
                       hint="raise LimitNOFILE, or add routers")  # fmt: skip
        self.status = 503
        return self._finish(api_error(
            503, "The router is out of resources (open files) for the moment; try again.",
            "server_error", "router_overloaded", self.rid, retry_after=1))  # fmt: skip

    async def _give_up(self, tried, reason: str) -> Answer | Stream:
        table = self.up.table
        if not tried:
            wait = table.retry_after(self.model, time.monotonic())
            message = (
                f"Every endpoint serving '{self.model}' failed recently; try again in {wait:.0f}s."
            )
            err = api_error(
                503,
                message,
                "server_error",
                "no_healthy_endpoint",
                self.rid,
                retry_after=max(1, round(wait)),
            )
        else:
            message = f"No endpoint serving '{self.model}' answered: {reason}"
            err = api_error(502, message, "server_error", "upstream_unavailable", self.rid)
        self.status = err.status
        if self.resp is not None:  # headers already went out as a stream: say it in-band
            await self._write_error_event(message, err.status)
            return self.resp
        return self._finish(err)

    def _ask_progress(self, ep: Endpoint, body: bytes) -> bytes:
        """The body, asking llama-server for the prompt's size at the stream's start
        (tokens.py), so a stream cut short still bills its prompt. The engine is the
        routing table's word, else the catalog's."""
        self.meter.progress = None
        if not self.stream:
            return body
        engine = ep.engine
        if not engine:
            info = self.up.policies.model(self.model)
            engine = info.engine if info is not None else None
        api = self.route.api
        native = api is not OPENAI and not self.translating
        name = api.name if api is not OPENAI else None
        if not tokens.wants_progress(engine, native, name):
            return body
        asked = tokens.ask_progress(body)
        if asked is None:
            return body
        self.meter.progress = tokens.Progress()
        return asked

    @property
    def failed_early(self) -> bool:
        """It failed (a 5xx, or no engine answered) before anything reached the client:
        another model may still answer."""
        return self.resp is None and self.status >= 500 and self.status != CLIENT_CLOSED
