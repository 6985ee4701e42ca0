"""One attempt to answer a request with one model: choose an endpoint, forward, retry
on another before anything reached the client, stream back, read usage.

The Proxy (proxy.py) decides who may ask and which model answers (limits, admission,
fallbacks); a Call does the talking to engines, and leaves accounting to the Proxy.
"""

import asyncio
import json
import time

from llmgw import log
from llmgw_router import metrics, prefix, sse
from llmgw_router.errors import ApiError, Untranslatable, api_error
from llmgw_router.exchange import Answer, Stream
from llmgw_router.meter import Meter, NativeStream, OpenAIStream
from llmgw_router.routing import Endpoint
from llmgw_router.splice import model_field, set_model
from llmgw_router.upstream import Response, UpstreamError

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


class Call:
    """One model's attempt at a request, from choosing an endpoint to the last byte."""

    __slots__ = (
        "up", "request", "route", "rid", "model", "stream", "client_usage", "headers",
        "t0", "t_first", "status", "endpoint", "meter", "overhead", "resp", "_keepalive",
        "_keepalive_task", "_waiting_first", "before_done", "_broke", "field", "translator",
        "translating", "affinity", "_framer", "_reader", "_answered",
    )  # fmt: skip

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
        self.affinity = None  # the prompt's prefix key, when routing by prefix (prefix.py)
        self._framer = None  # a stream's events as they come (sse.py)
        self._reader = None  # its API's reader: usage, content events, its end (meter.py)

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
                ep.outstanding += 1
                head = b"".join((line, ep.head, b"x-request-id: ", self.rid.encode(), b"\r\n"))
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
                        return self._out_of_resources(ep, e)
                    last_reason = self._upstream_failed(ep, e, e.kind)
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
                    if self.stream and upstream.status == 200:
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
            if self._keepalive_task is not None:
                await self._settle()
            return await self._give_up(tried, last_reason)
        finally:
            self._stop_keepalive()
            if self._keepalive_task is not None:
                self._keepalive_task.cancel()

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
        dialect = self.route.dialect
        if dialect is None:
            return self.route.head, body
        self.translating = (ep.url, self.route.path) in self.up.lacking
        if not self.translating and dialect.without:
            info = self.up.policies.model(self.model)
            self.translating = info is not None and info.engine in dialect.without
        if not self.translating:
            return self.route.head, body
        try:
            self.translator = dialect.translate(json.loads(body), self.up.served_name(self.model))
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
        if status not in _NO_SUCH_PATH or self.route.dialect is None or self.translating:
            return False
        if self._answered:
            return False
        self.up.lacking.add((ep.url, self.route.path))
        _log.info("engine_lacks_path", endpoint=ep.id, path=self.route.path, status=status)
        return True

    def _upstream_failed(self, ep: Endpoint, err, kind: str) -> str:
        reason = str(err) or type(err).__name__
        metrics.UPSTREAM_ERRORS.labels(ep.id, kind).inc()
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

    # -- relaying --------------------------------------------------------------------

    async def _relay_whole(self, upstream: Response) -> Answer | Stream | None:
        try:
            data = upstream.whole()
            if data is None:
                data = await upstream.read()
        except UpstreamError as e:
            return await self._engine_broke(e)
        if self._keepalive_task is not None:
            await self._settle()
        t = time.perf_counter()
        self.status = upstream.status
        if upstream.status == 200:
            self.meter.whole(data)
            if self.translating:
                data = self.translator.whole(data)
            else:
                data = set_model(data, self.field)
            data = self._final(data)
        elif self.resp is None:
            data = engine_error_body(upstream.status, data)
        if self.resp is not None:  # the stream was committed by a keepalive: say it in-band
            await self._write_error_event(error_message(data), upstream.status)
            return self.resp
        resp = Answer(
            upstream.status,
            data,
            {"Content-Type": upstream.headers.get("content-type", "application/json")},
        )
        self.overhead += time.perf_counter() - t
        return self._finish(resp)

    async def _relay_stream(self, upstream: Response) -> Answer | Stream | None:
        self.status = 200
        self._framer = sse.Framer()
        self._reader = self._stream_reader()
        key = self.affinity
        try:
            while (chunk := await upstream.next()) is not None:
                if key is not None and not key.answered_at:
                    prefix.answered(key, asyncio.get_running_loop().time())
                out = self._relay_piece(chunk)
                if out:
                    await self._write(out)
                if self.resp is not None and not self._waiting_first:
                    await self._push(upstream)
            out = self._relay_piece(b"", end=True)
            if out:
                await self._write(out)
        except UpstreamError as e:
            return await self._engine_broke(e)
        if not self.meter.ended:
            # An event cut off before its blank line is no event (as the standard says):
            # only a whole end event makes a stream complete.
            reason = self._upstream_failed(
                self.endpoint, "stream ended without its end event", kind="stream_interrupted"
            )
            if not self._answered:
                self._broke = reason
                return None
            self.status = 502
            await self._write_error_event("The engine ended the stream early.", 502)
            return self.resp
        await self.resp.write_eof()
        return self.resp

    def _stream_reader(self):
        """The reader of this attempt's stream: an OpenAI stream (chat, completions, or
        the chat stream a translation reads), or another API's own."""
        route = self.route
        if route.dialect is None or self.translating:
            return OpenAIStream(self.meter, self.client_usage or self.translating)
        return NativeStream(self.meter, route.ends, route.content)

    def _relay_piece(self, chunk: bytes, end: bool = False) -> bytes:
        """A piece of the engine's stream in (`end`: the stream's end); the whole events
        it completes out, as the client is to read them (the rest waits in the framer
        for the next piece)."""
        t = time.perf_counter()
        events = self._framer.close() if end else self._framer.feed(chunk)
        if not events:
            return b""
        meter = self.meter
        ended = meter.ended
        events = self._reader.read(events)
        if self.t_first is None and meter.events:
            self.t_first = t
            self._stop_keepalive()
        out = b""
        if events:
            if meter.ended and not ended:
                self._done()
                out = self._final(self._shape(events))
            else:
                out = self._shape(events)
        self.overhead += time.perf_counter() - t
        return out

    async def _push(self, upstream: Response) -> None:
        """Relay what follows from the engine connection's callback, each piece written
        to the client as it comes, with no task woken for it: a stream's chunks arrive
        one by one, and waking this task for each cost more CPU than relaying it. Back
        to the task when the stream ends or fails, or while the client is slow to read
        (the engine is then read no faster than the client reads). Only once the client
        has the stream's head and no keepalive can write alongside."""
        resp = self.resp
        push = getattr(resp, "push", None)  # the http1 transport's streams have it
        keepalive = self._keepalive_task
        if push is None or (keepalive is not None and not keepalive.done()):
            return
        self._answered = True  # what it pushes goes to the client unseen by _write
        failed = []

        def sink(piece: bytes) -> None:
            try:
                out = self._relay_piece(piece)
                if out and not push(out):
                    upstream.detach()
            except BaseException as e:  # noqa: BLE001 - raised again in the task
                failed.append(e)
                upstream.detach()

        await upstream.push(sink)
        if failed:
            raise failed[0]
        await resp.drain()

    def _shape(self, events: list[bytes]) -> bytes:
        """Events as the client's API says them, naming the served model."""
        if self.translator is not None:
            return self.translator.feed(events)
        return set_model(sse.join(events), self.field)

    def _final(self, data: bytes) -> bytes:
        """The whole answer, or a stream's last block, past the route's hook (the
        Responses API keeps it)."""
        hook = self.request.get("llmgw.on_answer")
        return (hook(data) or data) if hook is not None else data

    def _done(self) -> None:
        hook, self.before_done = self.before_done, None
        if hook is not None:
            hook()

    async def _engine_broke(self, err: UpstreamError) -> Answer | Stream | None:
        """The engine failed after it had started answering. Before anything reached the
        client, None: try another endpoint (an engine killed while it read a long prompt
        had sent its stream's headers, and the chaos suite saw that answered 502). After,
        too late: the client hears it."""
        reason = self._upstream_failed(self.endpoint, err, kind="stream_interrupted")
        if not self._answered:
            self._broke = reason
            return None
        self.status = 502
        message = f"The engine failed mid-response: {err}"
        if self.resp is None:
            return self._finish(
                api_error(502, message, "server_error", "upstream_interrupted", self.rid)
            )
        await self._write_error_event(message, 502)
        return self.resp

    # -- writing to the client ---------------------------------------------------------

    async def _ensure_stream(self) -> Stream:
        if self.resp is None:
            headers = self._client_headers(
                {
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            self.resp = await self.request.open_stream(200, headers)
        return self.resp

    async def _write(self, data: bytes) -> None:
        if self._keepalive_task is not None:
            await self._settle()
        resp = self.resp or await self._ensure_stream()
        self._answered = True
        await resp.write(data)

    async def _write_error_event(self, message: str, status: int) -> None:
        dialect = self.route.dialect
        if dialect is not None and dialect.error_event is not None:
            try:
                await self._write(dialect.error_event(message, status))
                await self.resp.write_eof()
            except ConnectionError:
                pass
            return
        body = {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": f"upstream_{status}",
            }
        }
        try:
            await self._write(sse.json_event(body))
            await self.resp.write_eof()
        except ConnectionError:
            pass  # the client left too; the usage row still says what happened

    def _client_headers(self, extra: dict) -> dict:
        extra["x-request-id"] = self.rid
        extra["x-llmgw-served-model"] = self.model
        if self.headers:
            extra.update(self.headers)
        return extra

    def _finish(self, resp: Answer) -> Answer:
        resp.headers["x-request-id"] = self.rid
        resp.headers["x-llmgw-served-model"] = self.model
        if self.headers:
            resp.headers.update(self.headers)
        return resp

    @property
    def failed_early(self) -> bool:
        """It failed (a 5xx, or no engine answered) before anything reached the client:
        another model may still answer."""
        return self.resp is None and self.status >= 500 and self.status != CLIENT_CLOSED

    # -- keepalive while waiting for the first token ----------------------------------

    def _arm_keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        self._keepalive = loop.call_later(self.up.keepalive_s, self._keepalive_due)

    def _keepalive_due(self) -> None:
        self._keepalive_task = asyncio.ensure_future(self._send_keepalive())

    async def _send_keepalive(self) -> None:
        try:
            resp = self.resp or await self._ensure_stream()
            await resp.write(sse.KEEPALIVE)
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
        """Let a keepalive write under way finish, so two writers never interleave.
        (Callers look at _keepalive_task first: most requests never had one.)"""
        task = self._keepalive_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.shield(task)


# -- helpers -----------------------------------------------------------------------------


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
