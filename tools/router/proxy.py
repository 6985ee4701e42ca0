"""The request path: parse, authorise, choose an endpoint, forward, stream back, account.

Everything a request touches lives here and in the in-memory structures it is given
(routing table, key cache, usage buffer), so the transport can be swapped without
touching the rest. Nothing here waits on the store.
"""

import asyncio
import json
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from llmgw import log
from llmgw_router import metrics
from llmgw_router.errors import api_error
from llmgw_router.keycache import KeyCache
from llmgw_router.routing import Endpoint, RoutingTable
from llmgw_router.upstream import Pool, Response, UpstreamError
from llmgw_router.usage import UsageWriter

_log = log.get("llmgw.router")

# HTTP status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499

# Engine answers that mean "try another one": it is down, overloaded or still loading.
_RETRY_STATUSES = frozenset((502, 503, 504))

# Upstream response headers passed on to the client.
_PASS_HEADERS = ("Content-Type",)

_DONE = b"data: [DONE]"


@dataclass
class Route:
    """One OpenAI operation: the engine path and the field that must hold the input."""

    path: str
    input_field: str
    input_types: tuple
    streams: bool
    head: bytes = b""  # the request line sent to the engine

    def __post_init__(self):
        self.head = f"POST {self.path} HTTP/1.1\r\n".encode()


CHAT = Route("/v1/chat/completions", "messages", (list,), True)
COMPLETIONS = Route("/v1/completions", "prompt", (str, list), True)
EMBEDDINGS = Route("/v1/embeddings", "input", (str, list), False)


class ClientGone(Exception):
    """The client disconnected while we were writing to it."""


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
        activation_s: float = 0.0,
        feed=None,
    ):
        self.table = table
        self.keys = keys
        self.usage = usage
        self.pool = pool
        self.max_body = max_body_bytes
        self.retries = retries
        self.keepalive_s = keepalive_interval_s
        self.activation_s = activation_s
        self.feed = feed  # the scheduler feed: wants and activity go through it

    # -- authorisation ---------------------------------------------------------------

    def authorise(self, request: web.Request, rid: str):
        """The caller's Key, or an error response."""
        if not self.keys.loaded.is_set():
            return api_error(
                503,
                "API keys are not loaded yet (is the store reachable?)",
                "server_error",
                "keys_not_loaded",
                rid,
                retry_after=2,
            )
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or len(auth) < 8:
            return api_error(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                "invalid_api_key",
                rid,
            )
        key = self.keys.lookup(auth[7:].strip())
        if key is None or (key.expires_at is not None and key.expires_at <= time.time()):
            return api_error(
                401,
                "Invalid, revoked or expired API key.",
                "invalid_request_error",
                "invalid_api_key",
                rid,
            )
        return key

    # -- handlers --------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        rid = request_id(request)
        key = self.authorise(request, rid)
        if isinstance(key, web.Response):
            return key
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "llmgw"}
            for m in self.table.models()
            if key.allows(m)
        ]
        return web.json_response({"object": "list", "data": data}, headers={"x-request-id": rid})

    def handler(self, route: Route):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.forward(request, route)

        return handle

    async def forward(self, request: web.Request, route: Route) -> web.StreamResponse:
        t0 = time.perf_counter()
        rid = request_id(request)
        key = self.authorise(request, rid)
        if isinstance(key, web.Response):
            return count(key, "")

        parsed = await self.parse(request, route, rid)
        if isinstance(parsed, web.Response):
            return self.reject(parsed, t0, rid, key.id, "")
        payload, body = parsed
        model = payload["model"]
        if not key.allows(model):
            return self.reject(
                api_error(
                    403,
                    f"This API key may not use model '{model}'.",
                    "permission_error",
                    "model_not_allowed",
                    rid,
                    param="model",
                ),
                t0,
                rid,
                key.id,
                model,
            )
        if self.feed is not None:
            self.feed.used(model, time.time())
        if not self.table.serves(model) and self.table.knows(model):
            if not await self.activate(model):
                return self.reject(self.not_ready(model, rid), t0, rid, key.id, model)
        if not self.table.serves(model):
            return self.reject(
                api_error(
                    404,
                    f"The model '{model}' does not exist.",
                    "invalid_request_error",
                    "model_not_found",
                    rid,
                    param="model",
                ),
                t0,
                rid,
                key.id,
                model,
            )

        stream = payload.get("stream") is True
        client_usage = True
        if stream:
            opts = payload.get("stream_options") or {}
            client_usage = bool(opts.get("include_usage"))
            if not client_usage:
                # Always ask for usage: it is what the usage row and budgets count.
                payload["stream_options"] = {**opts, "include_usage": True}
                body = json.dumps(payload).encode()

        call = Call(self, request, route, rid, key.id, model, stream, client_usage, t0)
        metrics.IN_FLIGHT.inc()
        try:
            return await call.run(body)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: aiohttp cancels the handler (or a write fails). Leaving
            # here closes the upstream response, so the engine frees its slot.
            call.status = CLIENT_CLOSED
            raise
        finally:
            metrics.IN_FLIGHT.dec()
            call.account()

    async def activate(self, model: str) -> bool:
        """Ask the scheduler for a model that has no ready replica and hold the request
        up to the activation window while it comes up. A parked or unplaceable model is
        asked for too — room may have been made since — but the client is answered at
        once, not kept waiting on a stale answer."""
        if self.feed is not None:
            self.feed.want(model)
        state, _ = self.table.status(model) or ("starting", "")
        if state in ("parked", "unplaceable") or self.activation_s <= 0:
            return False
        return await self.table.wait_served(model, self.activation_s)

    def not_ready(self, model: str, rid: str) -> web.Response:
        """A catalog model with no ready replica: wait for one that is coming, or hear at
        once why one will not come."""
        state, reason = self.table.status(model) or ("starting", "")
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

    def reject(self, resp: web.Response, t0: float, rid: str, key_id: str, model: str):
        """Answer an authenticated request that never reached an engine, and account it."""
        # A model nobody serves is not a label: clients could mint series at will.
        metrics.REQUESTS.labels(model if self.table.serves(model) else "", str(resp.status)).inc()
        latency_ms = (time.perf_counter() - t0) * 1000.0
        self.usage.record(
            (time.time(), rid, key_id, model[:200], None, None, 0, 0, resp.status, latency_ms, None)
        )
        return resp

    async def parse(self, request: web.Request, route: Route, rid: str):
        """(payload, raw body) or an error response."""
        if request.content_length is not None and request.content_length > self.max_body:
            return too_large(self.max_body, rid)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return too_large(self.max_body, rid)
        if len(body) > self.max_body:
            return too_large(self.max_body, rid)
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return api_error(
                400,
                "The request body is not valid JSON.",
                "invalid_request_error",
                "invalid_json",
                rid,
            )
        if not isinstance(payload, dict):
            return api_error(
                400,
                "The request body must be a JSON object.",
                "invalid_request_error",
                "invalid_json",
                rid,
            )
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            what = "missing" if model is None else "must be a non-empty string"
            return api_error(
                400,
                f"'model' is {what}.",
                "invalid_request_error",
                "invalid_value",
                rid,
                param="model",
            )
        field = route.input_field
        value = payload.get(field)
        if value is None:
            return api_error(
                400,
                f"'{field}' is missing.",
                "invalid_request_error",
                "missing_required_parameter",
                rid,
                param=field,
            )
        if not isinstance(value, route.input_types) or (isinstance(value, list) and not value):
            kinds = " or ".join(
                "a non-empty array" if t is list else "a string" for t in route.input_types
            )
            return api_error(
                400,
                f"'{field}' must be {kinds}.",
                "invalid_request_error",
                "invalid_type",
                rid,
                param=field,
            )
        if "stream" in payload:
            if not isinstance(payload["stream"], bool):
                return api_error(
                    400,
                    "'stream' must be true or false.",
                    "invalid_request_error",
                    "invalid_type",
                    rid,
                    param="stream",
                )
            if payload["stream"] and not route.streams:
                return api_error(
                    400,
                    f"{route.path} does not stream.",
                    "invalid_request_error",
                    "invalid_value",
                    rid,
                    param="stream",
                )
        opts = payload.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            return api_error(
                400,
                "'stream_options' must be an object.",
                "invalid_request_error",
                "invalid_type",
                rid,
                param="stream_options",
            )
        return payload, body


class Call:
    """One proxied request from the moment it is authorised to its usage row."""

    __slots__ = (
        "proxy", "request", "route", "rid", "key_id", "model", "stream", "client_usage",
        "t0", "t_first", "status", "endpoint", "prompt_tokens", "completion_tokens",
        "events", "overhead", "resp", "_keepalive", "_keepalive_task", "_waiting_first",
    )  # fmt: skip

    def __init__(self, proxy, request, route, rid, key_id, model, stream, client_usage, t0):
        self.proxy = proxy
        self.request = request
        self.route = route
        self.rid = rid
        self.key_id = key_id
        self.model = model
        self.stream = stream
        self.client_usage = client_usage
        self.t0 = t0
        self.t_first = None
        self.status = CLIENT_CLOSED  # until we know better
        self.endpoint: Endpoint | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.events = 0  # streamed content events, the fallback token count
        self.overhead = 0.0
        self.resp: web.StreamResponse | None = None  # set once headers went to the client
        self._keepalive = None
        self._keepalive_task = None
        self._waiting_first = False

    # -- the attempt loop ------------------------------------------------------------

    async def run(self, body: bytes) -> web.StreamResponse:
        proxy, table = self.proxy, self.proxy.table
        tried: list[Endpoint] = []
        last_reason = "no endpoint is available"
        if self.stream:
            self._waiting_first = True
            self._arm_keepalive()
        self.overhead = time.perf_counter() - self.t0
        try:
            for _attempt in range(proxy.retries + 1):
                now = time.monotonic()
                ep = table.pick(self.model, now, tried)
                if ep is None:
                    break
                tried.append(ep)
                self.endpoint = ep
                ep.outstanding += 1
                head = b"".join(
                    (self.route.head, ep.head, b"x-request-id: ", self.rid.encode(), b"\r\n")
                )
                try:
                    upstream = await proxy.pool.request(proxy.pool.origin(ep.url), head, body)
                except UpstreamError as e:
                    ep.outstanding -= 1
                    last_reason = self._upstream_failed(ep, e, e.kind)
                    continue
                try:
                    await self._settle()
                    if upstream.status in _RETRY_STATUSES and self.resp is None:
                        text = (await upstream.read())[:300].decode(errors="replace")
                        last_reason = self._upstream_failed(
                            ep, f"HTTP {upstream.status} {text}", kind=f"http_{upstream.status}"
                        )
                        continue
                    if self.stream and upstream.status == 200:
                        return await self._relay_stream(upstream)
                    return await self._relay_whole(upstream)
                finally:
                    ep.outstanding -= 1
                    ep.last_used = time.monotonic()
                    upstream.release()
            await self._settle()
            return await self._give_up(tried, last_reason)
        finally:
            self._stop_keepalive()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()

    def _upstream_failed(self, ep: Endpoint, err, kind: str) -> str:
        reason = str(err) or type(err).__name__
        metrics.UPSTREAM_ERRORS.labels(ep.id, kind).inc()
        self.proxy.table.failed(ep, time.monotonic())
        _log.warning(
            "upstream_failed",
            request_id=self.rid,
            endpoint=ep.id,
            model=self.model,
            kind=kind,
            reason=reason[:200],
        )
        return f"endpoint {ep.id}: {reason[:200]}"

    async def _give_up(self, tried, reason: str) -> web.StreamResponse:
        table = self.proxy.table
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

    # -- relaying --------------------------------------------------------------------

    async def _relay_whole(self, upstream: Response) -> web.StreamResponse:
        try:
            data = await upstream.read()
        except UpstreamError as e:
            return await self._engine_broke(e)
        await self._settle()
        t = time.perf_counter()
        self.status = upstream.status
        if upstream.status == 200:
            self._take_usage(data)
        elif self.resp is None:
            data = engine_error_body(upstream.status, data)
        if self.resp is not None:  # the stream was committed by a keepalive: say it in-band
            await self._write_error_event(error_message(data), upstream.status)
            return self.resp
        resp = web.Response(
            body=data,
            status=upstream.status,
            headers={"Content-Type": upstream.headers.get("content-type", "application/json")},
        )
        self.overhead += time.perf_counter() - t
        return self._finish(resp)

    async def _relay_stream(self, upstream: Response) -> web.StreamResponse:
        self.status = 200
        buf = b""
        done = False
        try:
            while (chunk := await upstream.next()) is not None:
                t = time.perf_counter()
                buf += chunk
                end = buf.rfind(b"\n\n")
                if end < 0:
                    continue
                out, buf = self._filter_events(buf[: end + 2]), buf[end + 2 :]
                if self.t_first is None and self.events:
                    self.t_first = t
                    self._stop_keepalive()
                if out:
                    await self._write(out)
                self.overhead += time.perf_counter() - t
                if out.endswith(_DONE + b"\n\n") or buf.startswith(_DONE):
                    done = True
            if buf.strip():
                await self._write(buf)
                done = done or buf.strip() == _DONE
        except UpstreamError as e:
            return await self._engine_broke(e)
        if not done:
            self._upstream_failed(
                self.endpoint, "stream ended without [DONE]", kind="stream_interrupted"
            )
            self.status = 502
            await self._write_error_event("The engine ended the stream early.", 502)
            return self.resp
        await self.resp.write_eof()
        return self.resp

    async def _engine_broke(self, err: UpstreamError) -> web.StreamResponse:
        """The engine failed after it had started answering: too late to retry."""
        self._upstream_failed(self.endpoint, err, kind="stream_interrupted")
        self.status = 502
        message = f"The engine failed mid-response: {err}"
        if self.resp is None:
            return self._finish(
                api_error(502, message, "server_error", "upstream_interrupted", self.rid)
            )
        await self._write_error_event(message, 502)
        return self.resp

    def _filter_events(self, block: bytes) -> bytes:
        """Count content events and take usage; drop the usage-only event unless asked."""
        if b'"usage"' not in block:
            self.events += block.count(b"data: {")
            return block
        kept = []
        for event in block.split(b"\n\n"):
            if not event:
                continue
            if event.startswith(b"data: {") and b'"usage"' in event:
                try:
                    obj = json.loads(event[6:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    self._set_usage(obj["usage"])
                    if obj.get("choices"):
                        self.events += 1
                    if not self.client_usage:
                        if not obj.get("choices"):
                            continue  # the usage-only chunk the client did not ask for
                        del obj["usage"]
                        event = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
                    kept.append(event)
                    continue
            if event.startswith(b"data: {"):
                self.events += 1
            kept.append(event)
        return b"".join(e + b"\n\n" for e in kept)

    def _take_usage(self, data: bytes) -> None:
        try:
            usage = json.loads(data).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self._set_usage(usage)

    def _set_usage(self, usage: dict) -> None:
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(p, int):
            self.prompt_tokens = p
        if isinstance(c, int):
            self.completion_tokens = c

    # -- writing to the client ---------------------------------------------------------

    async def _ensure_stream(self) -> web.StreamResponse:
        if self.resp is None:
            resp = web.StreamResponse(
                status=200,
                headers=self._client_headers(
                    {
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                    }
                ),
            )
            self.resp = resp
            await resp.prepare(self.request)
        return self.resp

    async def _write(self, data: bytes) -> None:
        await self._settle()
        resp = self.resp or await self._ensure_stream()
        await resp.write(data)

    async def _write_error_event(self, message: str, status: int) -> None:
        body = {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": f"upstream_{status}",
            }
        }
        try:
            await self._write(b"data: " + json.dumps(body).encode() + b"\n\n")
            await self.resp.write_eof()
        except ConnectionError:
            pass  # the client left too; the usage row still says what happened

    def _client_headers(self, extra: dict) -> dict:
        extra["x-request-id"] = self.rid
        extra["x-llmgw-served-model"] = self.model
        return extra

    def _finish(self, resp: web.Response) -> web.Response:
        resp.headers["x-request-id"] = self.rid
        resp.headers["x-llmgw-served-model"] = self.model
        return resp

    # -- keepalive while waiting for the first token ----------------------------------

    def _arm_keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        self._keepalive = loop.call_later(self.proxy.keepalive_s, self._keepalive_due)

    def _keepalive_due(self) -> None:
        self._keepalive_task = asyncio.ensure_future(self._send_keepalive())

    async def _send_keepalive(self) -> None:
        try:
            resp = self.resp or await self._ensure_stream()
            await resp.write(b": keepalive\n\n")
        except ConnectionError:
            return
        if self._waiting_first:
            self._arm_keepalive()

    def _stop_keepalive(self) -> None:
        self._waiting_first = False
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def _settle(self) -> None:
        """Let a keepalive write under way finish, so two writers never interleave."""
        task = self._keepalive_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.shield(task)

    # -- accounting ------------------------------------------------------------------

    def account(self) -> None:
        """Metrics and the usage row. Runs exactly once per call, whatever happened."""
        now = time.perf_counter()
        latency = now - self.t0
        status = self.status
        model = self.model
        ttft = (self.t_first - self.t0) if self.t_first is not None else None
        # A stream cut short has no usage chunk: count its content events instead.
        completion = self.completion_tokens or self.events
        metrics.REQUESTS.labels(model, str(status)).inc()
        metrics.DURATION.labels(model).observe(latency)
        if ttft is not None:
            metrics.TTFT.labels(model).observe(ttft)
        if self.prompt_tokens:
            metrics.TOKENS.labels(model, "prompt").inc(self.prompt_tokens)
        if completion:
            metrics.TOKENS.labels(model, "completion").inc(completion)
        metrics.OVERHEAD.observe(self.overhead)
        ep = self.endpoint
        self.proxy.usage.record(
            (
                time.time(),
                self.rid,
                self.key_id,
                model,
                model if ep else None,
                ep.id if ep else None,
                self.prompt_tokens,
                completion,
                status,
                latency * 1000.0,
                ttft * 1000.0 if ttft is not None else None,
            )
        )
        if status == CLIENT_CLOSED:
            _log.info(
                "client_disconnected",
                request_id=self.rid,
                model=model,
                endpoint=ep.id if ep else None,
                completion_tokens=completion,
            )


# -- helpers -----------------------------------------------------------------------------


def request_id(request: web.Request) -> str:
    rid = request.headers.get("x-request-id")
    if rid and len(rid) <= 64 and rid.isascii() and rid.isprintable():
        return rid
    return secrets.token_hex(8)


def count(resp: web.Response, model: str) -> web.Response:
    """Count a request answered before it reached an engine."""
    metrics.REQUESTS.labels(model, str(resp.status)).inc()
    return resp


def too_large(limit: int, rid: str) -> web.Response:
    return api_error(
        413,
        f"The request body is larger than {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
        rid,
    )


def error_message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return data[:300].decode(errors="replace")


def engine_error_body(status: int, data: bytes) -> bytes:
    """An engine's error, passed on in OpenAI's shape whatever shape it came in."""
    try:
        obj = json.loads(data)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return data
    except ValueError:
        pass
    text = data[:500].decode(errors="replace").strip() or f"HTTP {status}"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps(
        {
            "error": {
                "message": f"The engine answered: {text}",
                "type": kind,
                "param": None,
                "code": f"engine_{status}",
            }
        }
    ).encode()
