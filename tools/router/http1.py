"""router.transport = "http1": the router's HTTP/1.1 server, on asyncio protocols and
llhttp (through httptools), with nothing between a socket and the handlers.

One connection, one Conn. Requests are parsed as bytes arrive; a request whose head is
complete is served at once, and those pipelined behind it wait their turn, so answers
leave in the order the requests came. Each request is one task; a client that goes
away cancels it (the engine's request is dropped, its slot freed).

Limits (the router.* settings, read as they are), each answered in OpenAI's shape and
the connection closed: a request line over router.max_url_bytes (414), a head over
router.max_header_bytes (431), a body over router.max_body_bytes (413, judged by the
handler so it names the limit), a head not complete router.header_timeout_s after it
began or a body not complete router.body_timeout_s after its head (408). An idle
keep-alive connection is closed after router.idle_timeout_s.

Backpressure both ways: a client that reads slowly makes Stream.write wait (and so
the engine is read no faster), and a client that pipelines faster than it is answered
is not read until the queue shortens.
"""

import asyncio
import collections
import http
from urllib.parse import parse_qsl

import httptools
from multidict import CIMultiDict

from llmgw import log
from llmgw_router.errors import ApiError, api_error
from llmgw_router.exchange import Answer, BodyTooLarge, Stream
from llmgw_router.proxy import new_request_id, request_id

_log = log.get("llmgw.router")

_SWEEP_S = 0.5  # how often deadlines are looked at
_MAX_QUEUED = 8  # pipelined requests held before the connection is not read
_MAX_FIELDS = 200  # header lines in one request
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_REASONS[499] = b"Client Closed Request"


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


_STATUS_LINES = {s: status_line(s) for s in _REASONS}


def head(status: int, headers: dict, framing: bytes) -> bytes:
    """An answer's head: status line, headers as given (any with a CR or LF in it is
    left out, never sent split), then `framing` (Content-Length or chunked, and
    Connection), and the blank line."""
    line = _STATUS_LINES.get(status) or status_line(status)
    text = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    if text.count("\n") != len(headers):  # a CR or LF inside a name or a value
        text = "".join(
            [f"{k}: {v}\r\n" for k, v in headers.items() if _clean(k) and _clean(str(v))]
        )
    return b"".join((line, text.encode("latin-1", "replace"), framing, b"\r\n"))


def _clean(text: str) -> bool:
    return "\r" not in text and "\n" not in text


class _TooLong(Exception):
    def __init__(self, status: int, what: str):
        super().__init__(what)
        self.status = status


class Request:
    """One request as the handlers read it (exchange.py)."""

    __slots__ = ("conn", "app", "method", "path", "query_string", "headers", "match_info",
                 "content_length", "keep_alive", "version", "parts", "size", "complete",
                 "too_large", "waiter", "expect", "values", "head_only", "answered",
                 "_query")  # fmt: skip

    def __init__(self, conn: "Conn", method: str, url: bytes, headers: CIMultiDict):
        self.conn = conn
        self.app = conn.server.state
        self.method = method
        parsed = httptools.parse_url(url)
        self.path = parsed.path.decode("utf-8", "replace")
        self.query_string = parsed.query.decode("utf-8", "replace") if parsed.query else ""
        self._query = None
        self.headers = headers
        self.match_info = {}
        length = headers.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.keep_alive = True
        self.version = "1.1"
        self.parts: list[bytes] = []
        self.size = 0
        self.complete = False
        self.too_large = False
        self.waiter: asyncio.Future | None = None
        self.expect = headers.get("expect", "").lower() == "100-continue"
        self.values: dict = {}
        self.head_only = method == "HEAD"
        self.answered = False  # some of the answer went out

    @property
    def query(self) -> dict:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    async def read(self) -> bytes:
        if self.too_large:
            raise BodyTooLarge()
        if not self.complete:
            if self.expect and not self.answered:
                self.expect = False
                self.conn.write(_CONTINUE)
            self.waiter = self.conn.server.loop.create_future()
            await self.waiter
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    async def open_stream(self, status: int, headers: dict) -> "_Stream":
        chunked = self.version == "1.1"
        if not chunked:
            self.keep_alive = False  # HTTP/1.0: the end of the body is the connection's
        framing = b"Transfer-Encoding: chunked\r\n" if chunked else b""
        if not self.keep_alive:
            framing += b"Connection: close\r\n"
        self.answered = True
        # The head goes out with the body's first piece (a keepalive, or the first
        # events), one write rather than two: on this VM a stream's writes cost more
        # than its parsing.
        return _Stream(self, status, headers, chunked, head(status, headers, framing))

    def get(self, name, default=None):
        return self.values.get(name, default)

    def __setitem__(self, name, value):
        self.values[name] = value

    def _body(self, data: bytes) -> None:
        if self.too_large:
            return
        self.size += len(data)
        if self.size > self.conn.server.rc.max_body_bytes:
            self.too_large = True
            self.parts = []
            self.keep_alive = False
            self._wake(BodyTooLarge())
            return
        self.parts.append(data)

    def _done(self) -> None:
        self.complete = True
        self._wake(None)

    def _wake(self, err) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            if err is None:
                w.set_result(None)
            else:
                w.set_exception(err)


class _Stream(Stream):
    __slots__ = ("req", "status", "headers", "chunked", "ended", "_head")

    def __init__(self, req: Request, status: int, headers: dict, chunked: bool, head: bytes):
        self.req, self.status, self.headers = req, status, headers
        self.chunked = chunked
        self.ended = False
        self._head = head  # not written yet

    async def write(self, data: bytes, last: bool = False) -> None:
        if not self.push(data, last):
            await self.drain()

    def push(self, data: bytes, last: bool = False) -> bool:
        """write() without waiting, for a piece relayed from an engine connection's
        callback: False when the client is slow to read (await drain() before more).
        `last`: the body ends with it, in the same write."""
        conn = self.req.conn
        if conn.transport is None or conn.closing:
            raise ConnectionResetError("the client closed the connection")
        parts = self._parts(data, last)
        if parts:
            conn.transport.writelines(parts)
        return not conn.paused_writing

    def _parts(self, data: bytes, last: bool) -> list[bytes]:
        parts = []
        if self._head is not None:
            parts.append(self._head)
            self._head = None
        if not self.req.head_only:
            if data:
                parts += (b"%x\r\n" % len(data), data, b"\r\n") if self.chunked else (data,)
            if last and self.chunked:
                parts.append(b"0\r\n\r\n")
        if last:
            self.ended = True
        return parts

    async def drain(self) -> None:
        conn = self.req.conn
        if conn.paused_writing and conn.transport is not None:
            await conn.drained()

    async def write_eof(self) -> None:
        if self.ended:
            return
        parts = self._parts(b"", last=True)
        if parts:
            self.req.conn.write(b"".join(parts))


class Conn(asyncio.Protocol):
    """One client connection: parse, queue in order, serve, answer."""

    __slots__ = ("server", "transport", "parser", "url", "fields", "head_bytes", "in_head",
                 "receiving", "queue", "serving", "task", "closing", "paused_writing",
                 "paused_reading", "drain", "deadline", "broken", "field_bytes")  # fmt: skip

    def __init__(self, server: "Server"):
        self.server = server
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.fields: list = []
        self.head_bytes = 0
        self.in_head = False
        self.receiving: Request | None = None  # head done, body still coming
        self.queue: collections.deque[Request] = collections.deque()
        self.serving: Request | None = None
        self.task: asyncio.Task | None = None
        self.closing = False
        self.paused_writing = False
        self.paused_reading = False
        self.drain: asyncio.Future | None = None
        self.deadline = 0.0  # when the current wait (idle, head, body) runs out
        self.broken: Answer | None = None  # answered after the requests before it
        self.field_bytes = 0

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.conns.add(self)
        self.deadline = self.server.loop.time() + self.server.rc.idle_timeout_s

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.closing = True
        self.server.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: drop its engine request
        if self.drain is not None and not self.drain.done():
            self.drain.set_exception(ConnectionResetError("the client closed the connection"))
        for req in (self.receiving, *self.queue):
            if req is not None:
                req._wake(ConnectionResetError("the client closed the connection"))
        self.queue.clear()

    def eof_received(self):
        # The client closed its side: taken as gone, as aiohttp, uvicorn and nginx (by
        # default) take it. A half-close cannot be told from a close until a write
        # fails, and waiting for that would keep an abandoned request on an engine.
        return False

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        d, self.drain = self.drain, None
        if d is not None and not d.done():
            d.set_result(None)

    async def drained(self) -> None:
        if self.drain is None:
            self.drain = self.server.loop.create_future()
        await self.drain

    def data_received(self, data: bytes) -> None:
        if self.closing or self.broken is not None:
            return
        if self.in_head:
            # The parser keeps a header's pieces until the header ends: bound them here.
            self.head_bytes += len(data)
            if self.head_bytes > self.server.rc.max_header_bytes + self.server.rc.max_url_bytes:
                self._refuse(431, "The request's headers are too large.", "headers_too_large")
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._pause_reading()  # no upgrades: answer what came, then close
            if self.serving is not None:
                self.serving.keep_alive = False
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _TooLong):
                code = "url_too_long" if cause.status == 414 else "headers_too_large"
                self._refuse(cause.status, str(cause), code)
            else:
                raise
        except httptools.HttpParserError as e:
            self._refuse(400, f"Malformed HTTP request: {e}.", "bad_request")

    # -- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.in_head = True
        self.url = b""
        self.fields = []
        self.head_bytes = self.field_bytes = 0
        self.deadline = self.server.loop.time() + self.server.rc.header_timeout_s

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.server.rc.max_url_bytes:
            raise _TooLong(414, "The request line is too long.")

    def on_header(self, name: bytes, value: bytes) -> None:
        # As little as can be: a client such as openai's sends 15 or more headers. They
        # are decoded together once the head is complete.
        self.fields.append((name, value))
        self.field_bytes += len(name) + len(value) + 4
        if self.field_bytes > self.server.rc.max_header_bytes:
            raise _TooLong(431, "The request's headers are too large.")

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0
        fields = self.fields
        if len(fields) > _MAX_FIELDS:
            raise _TooLong(431, "The request's headers are too large.")
        parser = self.parser
        headers = CIMultiDict([(n.decode("latin-1"), v.decode("latin-1")) for n, v in fields])
        req = Request(self, parser.get_method().decode("latin-1"), self.url, headers)
        self.url, self.fields = b"", []  # an idle connection keeps nothing of the last
        req.version = parser.get_http_version()
        req.keep_alive = parser.should_keep_alive()
        if req.content_length is not None and req.content_length > self.server.rc.max_body_bytes:
            req.too_large = True
            req.keep_alive = False
        self.receiving = req
        self.deadline = self.server.loop.time() + self.server.rc.body_timeout_s
        if self.serving is None:
            self._serve(req)
        else:
            self.queue.append(req)
            if len(self.queue) >= _MAX_QUEUED:
                self._pause_reading()

    def on_body(self, body: bytes) -> None:
        self.receiving._body(body)

    def on_message_complete(self) -> None:
        req, self.receiving = self.receiving, None
        if req is not None:
            req._done()

    # -- serving -------------------------------------------------------------------------

    def _serve(self, req: Request) -> None:
        self.serving = req
        self.task = self.server.loop.create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        server = self.server
        handler, req.match_info = server.routes.resolve(req.method, req.path)
        try:
            got = await handler(req)
        except asyncio.CancelledError:
            return  # the connection is gone
        except ApiError as e:
            got = e.answer(request_id(req))
        except Exception:
            _log.exception("handler_failed", path=req.path)
            if req.answered:
                self._close()
                return
            got = api_error(500, "The router failed to answer this request.",
                            "server_error", "internal_error", request_id(req))  # fmt: skip
        if isinstance(got, Answer):
            self._answer(req, got)
        elif isinstance(got, _Stream) and not got.ended:
            req.keep_alive = False  # the stream was cut: only closing says so
        self._next(req)

    def _answer(self, req: Request, got: Answer) -> None:
        body = got.body
        keep = req.keep_alive
        framing = b"Content-Length: %d\r\n" % len(body)
        if not keep:
            framing += b"Connection: close\r\n"
        elif req.version == "1.0":
            framing += b"Connection: keep-alive\r\n"
        req.answered = True
        if req.head_only:
            self.write(head(got.status, got.headers, framing))
        else:
            self.write(head(got.status, got.headers, framing) + body)

    def _next(self, done: Request) -> None:
        """The answer to `done` is out: serve the next request, or close."""
        self.serving = None
        self.task = None
        if not done.keep_alive or not done.complete or self.closing:
            # A body not read to its end leaves the connection's framing unknown.
            self._close()
            return
        if self.queue:
            req = self.queue.popleft()
            if self.paused_reading and len(self.queue) < _MAX_QUEUED // 2:
                self._resume_reading()
            self._serve(req)
            return
        if self.broken is not None:
            self.write(_whole(self.broken))
            self._close()
            return
        if self.receiving is None and not self.in_head:
            self.deadline = self.server.loop.time() + self.server.rc.idle_timeout_s

    # -- refusing and closing ------------------------------------------------------------

    def _refuse(self, status: int, message: str, code: str) -> None:
        """A request that cannot be parsed or is over a limit: answered after the ones
        before it, then the connection closes."""
        self.broken = api_error(status, message, "invalid_request_error", code, new_request_id())
        self._pause_reading()
        cut, self.receiving = self.receiving, None
        if cut is not None and cut is self.serving:
            # Its body broke off: it is the one answered, now.
            self.task.cancel()
            self.serving = None
        elif cut is not None and cut in self.queue:
            self.queue.remove(cut)
        if self.serving is None:
            self.write(_whole(self.broken))
            self._close()

    def timed_out(self) -> None:
        """Called by the sweep: a wait ran out."""
        if self.serving is not None and self.receiving is not self.serving:
            return  # being answered: the engine's timeouts apply, not ours
        if self.in_head or self.receiving is not None:
            what = "headers" if self.in_head else "body"
            if self.serving is None or not self.serving.answered:
                self.broken = api_error(408, f"The request's {what} came too slowly.",
                                        "invalid_request_error", "request_timeout",
                                        new_request_id())  # fmt: skip
                self.write(_whole(self.broken))
        self._close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(data)

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()  # after what is buffered has gone

    def _pause_reading(self) -> None:
        if not self.paused_reading and self.transport is not None:
            self.paused_reading = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.paused_reading and self.transport is not None and self.broken is None:
            self.paused_reading = False
            self.transport.resume_reading()

    def idle(self) -> bool:
        return self.serving is None and not self.queue and not self.in_head


def _whole(answer: Answer) -> bytes:
    framing = b"Content-Length: %d\r\nConnection: close\r\n" % len(answer.body)
    return head(answer.status, answer.headers, framing) + answer.body


class Server:
    """The listening socket, its connections and their deadlines."""

    def __init__(self, routes, state: dict, rc):
        self.routes, self.state, self.rc = routes, state, rc  # rc: the [router] settings
        self.conns: set[Conn] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.AbstractServer | None = None
        self._sweep = None

    async def listen(self, host: str, port: int, ssl=None) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = await self.loop.create_server(
            lambda: Conn(self), host, port, ssl=ssl, backlog=4096, reuse_address=True
        )
        self._sweep = self.loop.call_later(_SWEEP_S, self.sweep)

    def sweep(self) -> None:
        now = self.loop.time()
        for conn in [c for c in self.conns if c.deadline < now]:
            conn.timed_out()
        self._sweep = self.loop.call_later(_SWEEP_S, self.sweep)

    async def close(self, grace_s: float) -> None:
        """Stop listening; let requests under way finish (up to `grace_s`), closing each
        connection as it goes idle; then cut what is left."""
        if self.server is not None:
            self.server.close()
        deadline = self.loop.time() + grace_s
        while self.conns and self.loop.time() < deadline:
            for conn in list(self.conns):
                if conn.idle():
                    conn._close()
                elif conn.serving is not None:
                    conn.serving.keep_alive = False
            await asyncio.sleep(0.05)
        for conn in list(self.conns):
            if conn.task is not None and not conn.task.done():
                conn.task.cancel()
            if conn.transport is not None:
                conn.transport.abort()
        if self._sweep is not None:
            self._sweep.cancel()
