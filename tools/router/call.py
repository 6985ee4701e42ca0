"""One attempt to answer a request with one model: choose an endpoint, forward, retry
on another before anything reached the client, stream back, read usage.

The Proxy (proxy.py) decides who may ask and which model answers (limits, admission,
fallbacks); a Call does the talking to engines, and leaves accounting to the Proxy.
"""

import asyncio
import functools
import json
import time

from llmgw import log
from llmgw_router import metrics, prefix, tokens
from llmgw_router.errors import ApiError, Untranslatable, api_error
from llmgw_router.exchange import Answer, Stream, loads
from llmgw_router.prefix import cached_tokens, decode_weight
from llmgw_router.routing import Endpoint
from llmgw_router.upstream import Response, UpstreamError

_log = log.get("llmgw.router")

# HTTP status recorded for a request whose client went away (nginx's convention).
CLIENT_CLOSED = 499

# Engine answers that mean "try another one": it is down, overloaded or still loading.
_RETRY_STATUSES = frozenset((502, 503, 504))

_DONE = b"data: [DONE]"
_MODEL_KEY = b'"model"'

# An engine's answer on a path it does not serve at all (rather than a bad request).
_NO_SUCH_PATH = frozenset((404, 405, 501))
_CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\n"


@functools.lru_cache(maxsize=1024)
def model_field(name: str) -> bytes:
    """The `"model":"NAME"` an answer should carry, as bytes to splice in."""
    return b'"model":' + json.dumps(name).encode()


def set_model(data: bytes, field: bytes) -> bytes:
    """Every `"model": "..."` member of the JSON in `data` (one answer, or a block of SSE
    events) set to `field` (from model_field), without parsing or re-serialising.

    Sound on valid JSON: a `"` that no backslash escapes always opens or closes a
    string, and a string followed by `:` is a member's name, so an unescaped
    `"model"` then `:` is that member and never text inside a string (where its quotes
    would be escaped). Only string values are replaced; a member already holding the
    name is left alone, so an engine started with the served name as its alias costs a
    search and a comparison.

    The usual block is one engine's events, every member naming the model alike: when
    each `"model"` in it is where `field` (or the engine's one name for it) begins, it
    is one bytes.replace (or nothing), done in C. A quote before `model` that a
    backslash escapes could begin a name that only ends in `model`; such a block takes
    the careful way.
    """
    n = data.count(_MODEL_KEY)
    if n == 0 or n == data.count(field):
        return data
    if _ESCAPED_MODEL_KEY not in data:
        i = data.find(_MODEL_KEY)
        end = _member_end(data, i)
        if end > 0:
            engines = data[i:end]
            if data.count(engines) == n:
                return data.replace(engines, field)
    return _set_model_each(data, field)


_ESCAPED_MODEL_KEY = b'\\"model"'


def _member_end(data: bytes, i: int) -> int:
    """Just past the string value of the `"model"` member whose name's quote is at `i`
    (-1: it is not a member with a string value, or the bytes are not JSON)."""
    if not _unescaped(data, i):
        return -1
    n = len(data)
    j = i + len(_MODEL_KEY)
    while j < n and data[j] in b" \t\r\n":
        j += 1
    if j >= n or data[j] != 0x3A:  # ':'
        return -1
    j += 1
    while j < n and data[j] in b" \t\r\n":
        j += 1
    if j >= n or data[j] != 0x22:  # '"'
        return -1
    return _string_end(data, j)


def _set_model_each(data: bytes, field: bytes) -> bytes:
    """set_model, one member at a time."""
    out = None
    pos = pos_done = 0
    n = len(data)
    while (i := data.find(_MODEL_KEY, pos)) >= 0:
        pos = i + len(_MODEL_KEY)
        b = i - 1
        while b >= 0 and data[b] == 0x5C:  # backslashes before the quote
            b -= 1
        if (i - 1 - b) % 2:
            continue  # an escaped quote: text inside a string
        j = pos
        while j < n and data[j] in b" \t\r\n":
            j += 1
        if j >= n or data[j] != 0x3A:  # ':'
            continue  # the string "model" as a value, not a member's name
        j += 1
        while j < n and data[j] in b" \t\r\n":
            j += 1
        if j >= n or data[j] != 0x22:  # '"': only string values are replaced
            continue
        end = j + 1
        while True:
            end = data.find(b'"', end)
            if end < 0:  # not JSON after all: leave the rest as it came
                return data if out is None else b"".join(out) + data[pos_done:]
            k = end - 1
            while data[k] == 0x5C:
                k -= 1
            if (end - 1 - k) % 2 == 0:
                break
            end += 1
        end += 1  # past the closing quote
        if data[i:end] == field:
            pos = end
            continue
        if out is None:
            out = []
        out.append(data[pos_done:i])
        out.append(field)
        pos_done = pos = end
    return data if out is None else b"".join(out) + data[pos_done:]


_USAGE_KEY = b'"usage"'
_WS = b" \t\r\n"


def _unescaped(data: bytes, quote: int) -> bool:
    """The `"` at `quote` is not escaped by a backslash."""
    b = quote - 1
    while b >= 0 and data[b] == 0x5C:
        b -= 1
    return (quote - 1 - b) % 2 == 0


def _string_end(data: bytes, start: int) -> int:
    """Just past the string whose opening quote is at `start` (-1: it does not end)."""
    end = start + 1
    while (end := data.find(b'"', end)) >= 0:
        if _unescaped(data, end):
            return end + 1
        end += 1
    return -1


def _object_end(data: bytes, start: int) -> int:
    """Just past the JSON object whose `{` is at `start`, braces in strings skipped
    (-1: it does not end)."""
    depth, i, n = 0, start, len(data)
    while i < n:
        c = data[i]
        if c == 0x22:
            i = _string_end(data, i)
            if i < 0:
                return -1
            continue
        if c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def without_usage(event: bytes) -> bytes | None:
    """`event` (one `data: {...}` SSE event whose top-level `usage` is an object) with
    that member cut out of the bytes; None where that cannot be told from the bytes
    alone (the caller then parses and re-serialises).

    Sound on valid JSON, by set_model's argument: an unescaped `"usage"` followed by `:`
    is a member's name, never text in a string. The caller knows (it parsed the event)
    that the top level has one holding an object, so if the bytes hold exactly one such
    name, it is that member, and its value runs from its `{` to the matching `}`. Cutting
    the name, the value and one comma beside them leaves the same object without
    `usage`, each other member's bytes as the engine wrote them: what json.dumps would
    write for it whenever the engine writes compact JSON, as engines do (the unit test
    checks this over the captured streams)."""
    found = -1
    pos = 0
    while (i := event.find(_USAGE_KEY, pos)) >= 0:
        pos = i + len(_USAGE_KEY)
        if not _unescaped(event, i):
            continue
        j = pos
        while j < len(event) and event[j] in _WS:
            j += 1
        if j >= len(event) or event[j] != 0x3A:
            continue  # "usage" as a value
        if found >= 0:
            return None  # a second member named usage, at some depth: cannot tell which
        found = i
        value = j + 1
    if found < 0:
        return None
    while value < len(event) and event[value] in _WS:
        value += 1
    if value >= len(event) or event[value] != 0x7B:
        return None
    end = _object_end(event, value)
    if end < 0:
        return None
    after = end
    while after < len(event) and event[after] in _WS:
        after += 1
    if after < len(event) and event[after] == 0x2C:  # a member follows: take its comma
        return event[:found] + event[after + 1 :].lstrip(_WS)
    before = found - 1
    while before >= 0 and event[before] in _WS:
        before -= 1
    if before >= 0 and event[before] == 0x2C:  # the last member: take the comma before
        return event[:before] + event[end:]
    return None  # the only member: not a chunk worth keeping as it is


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
        "t0", "t_first", "status", "endpoint", "prompt_tokens", "completion_tokens",
        "events", "overhead", "resp", "_keepalive", "_keepalive_task", "_waiting_first",
        "before_done", "_broke", "field", "translator", "translating", "affinity", "cached",
        "decode_weight", "_tail", "_ended", "_end", "cached_tokens", "progress",
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
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.events = 0  # streamed content events, the fallback token count
        self.overhead = 0.0
        self.resp: Stream | None = None  # set once headers went to the client
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
        self.cached = None  # prompt tokens the engine said it reused from its cache
        self.decode_weight = None  # what its timings say a decoded token costs (prefix.py)
        # What the usage row says of the prompt: of its tokens, those the engine reused
        # (kept for the row, where `cached` is the prefix index's and cleared after each
        # attempt), and llama-server's early prompt counts of a stream (tokens.py).
        self.cached_tokens = None
        self.progress: tokens.Progress | None = None

    # -- the attempt loop ------------------------------------------------------------

    async def run(self, body: bytes) -> Answer | Stream:
        up, table = self.up, self.up.table
        tried: list[Endpoint] = []
        last_reason = "no endpoint is available"
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
                    if upstream.status in _RETRY_STATUSES and self.resp is None:
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
                    self.prompt_tokens = self.completion_tokens = self.events = 0
                    self.cached_tokens = None
                    continue
                finally:
                    ep.outstanding -= 1
                    self._routed(ep)
                    self.cached = self.decode_weight = None
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
                ep, self.affinity, self.prompt_tokens, self.cached, self.decode_weight
            )
            metrics.prefix_observed(self.model, out, self.prompt_tokens)

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
        if self.resp is not None:
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
            self._take_usage(data)
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
        self._tail = b""
        self._ended = False
        # A chat stream ends with [DONE]; another API's own stream with its own event.
        self._end = _DONE if self.translating or self.route.dialect is None else self.route.done
        key = self.affinity
        try:
            while (chunk := await upstream.next()) is not None:
                out = self._relay_piece(chunk)
                # Not at a prompt-progress event: the engine has not begun answering.
                if key is not None and not key.answered_at and (out or self.progress is None):
                    prefix.answered(key, asyncio.get_running_loop().time())
                if out:
                    await self._write(out)
                if self.resp is not None and not self._waiting_first:
                    await self._push(upstream)
            tail = self._tail.strip()
            if tail:
                if tail.startswith(self._end):
                    self._done()
                    self._ended = True
                await self._write(self._final(self._shape(self._tail)))
        except UpstreamError as e:
            return await self._engine_broke(e)
        if not self._ended:
            reason = self._upstream_failed(
                self.endpoint, "stream ended without [DONE]", kind="stream_interrupted"
            )
            if self.resp is None:
                self._broke = reason
                return None
            self.status = 502
            await self._write_error_event("The engine ended the stream early.", 502)
            return self.resp
        await self.resp.write_eof()
        return self.resp

    def _relay_piece(self, chunk: bytes) -> bytes:
        """A piece of the engine's stream in; the whole events it completes out, as the
        client is to read them (the rest waits in _tail for the next piece)."""
        t = time.perf_counter()
        buf = self._tail + chunk if self._tail else chunk
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._tail = buf
            return b""
        out, self._tail = self._filter_events(buf[: cut + 2]), buf[cut + 2 :]
        if self.t_first is None and self.events:
            self.t_first = t
            self._stop_keepalive()
        last = self._end in out
        if last or self._tail.startswith(self._end):
            self._ended = True
        if out:
            if last:
                self._done()
                out = self._final(self._shape(out))
            else:
                out = self._shape(out)
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

    def _shape(self, events: bytes) -> bytes:
        """Events as the client's API says them, naming the served model."""
        if self.translator is not None:
            return self.translator.feed(events)
        return set_model(events, self.field)

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
        if self.resp is None:
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

    def _filter_events(self, block: bytes) -> bytes:
        """Count content events and take usage; drop the usage-only event unless asked."""
        if self.progress is not None:
            block = self.progress.take(block)
        if self.route.dialect is not None and not self.translating:
            events, usages = native_events(block)
            self.events += events
            for usage in usages:
                self._set_usage(usage)
            return block
        first = block.find(b'"usage"')
        if first < 0:
            self.events += block.count(b"data: {")
            return block
        # The events before the first that mentions usage pass as they are: counted,
        # not taken apart (a block is often a whole stream, usage only at its end).
        start = block.rfind(b"\n\n", 0, first) + 2  # 1: no event before it
        start = 0 if start == 1 else start
        head = block[:start]
        self.events += head.count(b"data: {")
        kept = []
        for event in block[start:].split(b"\n\n"):
            if not event:
                continue
            if event.startswith(b"data: {") and b'"usage"' in event:
                try:
                    obj = json.loads(event[6:])
                except ValueError:
                    obj = None
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    self._set_usage(obj["usage"], obj)
                    if obj.get("choices"):
                        self.events += 1
                    if not self.client_usage:
                        if not obj.get("choices"):
                            continue  # the usage-only chunk the client did not ask for
                        # Cut out of the bytes rather than parsed and written again.
                        cut = without_usage(event)
                        if cut is None:
                            del obj["usage"]
                            cut = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
                        event = cut
                    kept.append(event)
                    continue
            if event.startswith(b"data: {"):
                self.events += 1
            kept.append(event)
        return head + b"".join(e + b"\n\n" for e in kept)

    def _take_usage(self, data: bytes) -> None:
        try:
            answer = loads(data)
            usage = answer.get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self._set_usage(usage, answer)

    def _set_usage(self, usage: dict, answer: dict | None = None) -> None:
        cached = cached_tokens(answer if answer is not None else {"usage": usage})
        if answer is not None and self.affinity is not None:
            self.decode_weight = decode_weight(answer)
        # OpenAI's names, or Anthropic's and the Responses API's (tokens.counts).
        p, c, said = tokens.counts(usage)
        cached = cached if cached is not None else said
        if cached is not None:
            self.cached = self.cached_tokens = cached
        if p is not None:
            self.prompt_tokens = p
        if c is not None:
            self.completion_tokens = c

    def _ask_progress(self, ep: Endpoint, body: bytes) -> bytes:
        """The body, asking llama-server for the prompt's size at the stream's start
        (tokens.py), so a stream cut short still bills its prompt. The engine is the
        routing table's word, else the catalog's."""
        self.progress = None
        if not self.stream:
            return body
        engine = ep.engine
        if not engine:
            info = self.up.policies.model(self.model)
            engine = info.engine if info is not None else None
        dialect = self.route.dialect
        native = dialect is not None and not self.translating
        name = dialect.name if dialect is not None else None
        if not tokens.wants_progress(engine, native, name):
            return body
        asked = tokens.ask_progress(body)
        if asked is None:
            return body
        self.progress = tokens.Progress()
        return asked

    def prompt_counts(self) -> tuple[int, int | None]:
        """(prompt tokens, of which cached) for the usage row: the engine's usage, else
        what its first prompt-progress event said (a stream cut before its end)."""
        if self.prompt_tokens or self.progress is None or self.progress.total is None:
            return self.prompt_tokens, self.cached_tokens
        return self.progress.total, self.progress.cached

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
            await self._write(b"data: " + json.dumps(body).encode() + b"\n\n")
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
        """Let a keepalive write under way finish, so two writers never interleave.
        (Callers look at _keepalive_task first: most requests never had one.)"""
        task = self._keepalive_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.shield(task)


# -- helpers -----------------------------------------------------------------------------


def native_events(block: bytes) -> tuple[int, list[dict]]:
    """Content events and usage objects in a block of another API's SSE events (Anthropic's
    `event: …` / `data: {…}` pairs, the Responses API's): usage sits at the top of an
    event, in its `message` (message_start) or in its `response` (response.completed)."""
    events = block.count(b"_delta")
    usages = []
    if b'"usage"' in block:
        for event in block.split(b"\n\n"):
            i = event.find(b"data: {")
            if i < 0 or b'"usage"' not in event:
                continue
            try:
                obj = json.loads(event[i + 6 :])
            except ValueError:
                continue
            for holder in (obj, obj.get("message"), obj.get("response")):
                if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
                    usages.append(holder["usage"])
    return events, usages


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
