"""A small HTTP/1.1 client for talking to engines, on plain asyncio protocols and llhttp
(through httptools, as the router's own server parses requests).

The router's profile showed aiohttp's client costing more CPU per request than the
rest of the request path together. Engines speak simple HTTP/1.1 (a JSON body with
Content-Length, or a chunked SSE stream), so this client does just that: one write per
request, llhttp's callbacks handing body pieces to the caller as they arrive, kept-alive
connections per endpoint, and one sweep for every request's deadline (a timer per
request cost more than the deadline was worth: it is checked to within a second).

What llhttp decides, and so this client: interim answers (100, 103) are passed over
for the one that follows; 204 and 304 have no body whatever their Content-Length says;
a body with neither Content-Length nor chunked framing runs to the connection's close;
a response that breaks HTTP/1.1's framing rules (Content-Length with chunked, two
Content-Lengths, a bad chunk size, a header line without a colon) is a protocol error,
never guessed at. llhttp cannot know a response answers HEAD, so this client sends none.

    pool = Pool(connect_timeout=3, total_timeout=600)
    resp = await pool.request(origin, b"POST /v1/completions HTTP/1.1\\r\\n...", body)
    resp.status, resp.headers            # headers: lower-case names
    data = await resp.read()             # or: while (piece := await resp.next()) ...
    resp.release()                       # back to the pool if reusable, else closed
"""

import asyncio
import collections
import errno
import socket
import ssl as ssl_module
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """Talking to an engine failed; `kind` says how (connect, timeout, closed, protocol,
    or local: this router is out of file descriptors or memory, and no engine is to
    blame)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# A connect that fails for want of something on this machine (file descriptors, socket
# buffers, local ports): the engine may be fine, and every other one would fail alike.
_LOCAL_ERRNOS = frozenset(
    (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL)
)


class Origin:
    """Where an endpoint lives, and the request head bytes that never change for it."""

    __slots__ = ("host", "port", "ssl", "host_header", "idle", "retired", "open", "waiters")

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: want http://host:port or https://host:port")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = parts.netloc.encode()
        self.idle: collections.deque[Connection] = collections.deque()
        self.retired = False  # it left the routing table: connections close when done
        self.open = 0  # connections open or opening, idle or busy
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    def closed_one(self) -> None:
        """A connection is gone: one waiting for room may open one."""
        self.open -= 1
        self.wake_one()

    def wake_one(self) -> None:
        while self.waiters:
            w = self.waiters.popleft()
            if not w.done():
                w.set_result(None)
                return


# Bytes of body waiting for the caller before we stop reading from the engine.
_HIGH_WATER = 1 << 20
# A response head larger than this is refused (llhttp itself sets no bound).
_MAX_HEAD = 65536


class _Stray(Exception):
    """The engine began another response after the one asked for had ended."""


class Connection(asyncio.Protocol):
    """One connection to an engine. llhttp (httptools) parses its responses, one after
    another for the connection's life; the callbacks below only note what it found."""

    __slots__ = (
        "origin", "transport", "parser", "fields", "head_bytes", "headed", "got", "status",
        "headers", "keep_alive", "until_close", "pieces", "buffered", "paused", "waiter",
        "error", "got_bytes", "complete", "head", "counted", "deadline", "loop", "sink",
    )  # fmt: skip

    def __init__(self, origin: Origin):
        self.origin = origin
        self.transport = None
        self.error: UpstreamError | None = None
        self.counted = False  # holds one of its origin's places (Pool.max_conns)
        self.deadline = 0.0  # when the request under way times out (Pool's sweep)
        self.loop = None
        self.parser = httptools.HttpResponseParser(self)
        self.got: list[bytes] = []  # body pieces parsed from the read being handled
        self._reset()

    def _reset(self) -> None:
        self.fields: list = []
        self.head_bytes = 0
        self.headed = False  # the final response's head is in
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.until_close = False  # the body is delimited by the connection closing
        self.pieces: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future | None = None
        self.got_bytes = False
        self.complete = False
        self.head: asyncio.Future | None = None  # set while a request is under way
        # Set while the caller takes the body as it comes (push): each piece is handed
        # to it from data_received, with no task woken for it.
        self.sink = None

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        # Kept: asyncio.get_running_loop() costs a getpid() system call on Python 3.11.
        self.loop = asyncio.get_running_loop()

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.counted:
            self.counted = False
            self.origin.closed_one()
        if not self.complete:
            if self.until_close:
                # httptools has no llhttp_finish(): the close that ends such a body is
                # ours to see.
                self.complete = True
                self._wake()
            else:
                what = "mid-response" if self.headed else "before answering"
                self._fail(UpstreamError("closed", f"engine closed the connection {what}"))

    def data_received(self, data: bytes) -> None:
        if self.head is None or self.complete:
            # Nothing was asked, or the answer has ended: whatever this is, it is no
            # answer to the next request, so the connection is not used again.
            self.keep_alive = False
            if self.head is None:
                self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            failed = "engine switched protocols"
        except (httptools.HttpParserError, httptools.HttpParserCallbackError) as e:
            failed = f"engine sent a malformed HTTP response ({e})"
        else:
            failed = None
            if not self.headed:
                self.head_bytes += len(data)
                if self.head_bytes > _MAX_HEAD:
                    failed = "engine sent a response head over 64 KiB"
        got = self.got
        if got:  # every piece of this read handed on together: one wake-up, one write
            self._deliver(got[0] if len(got) == 1 else b"".join(got))
            got.clear()
        if failed is not None and not self.complete:
            self._fail(UpstreamError("protocol", failed))
            self.close()
        elif self.complete:
            if failed is not None:
                self.keep_alive = False  # bytes after the answer (_Stray, or garbage)
            self._wake()

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Stray()

    def on_header(self, name: bytes, value: bytes) -> None:
        # Kept as they come, decoded together once the head is in; after the head
        # (chunked trailers) they are not read.
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        status = parser.get_status_code()
        fields, self.fields = self.fields, []
        if status < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        self.status = status
        # llhttp keeps a value's trailing whitespace; the names are lower-cased for the
        # caller (last one wins, as before).
        self.headers = headers = {n.decode("latin-1").lower(): v.decode("latin-1").rstrip()
                                  for n, v in fields}  # fmt: skip
        self.headed = True
        if not parser.should_keep_alive():
            self.keep_alive = False
            # llhttp reads such a body to the connection's end (no llhttp_finish()
            # here to end it: connection_lost does).
            te = headers.get("transfer-encoding", "")
            self.until_close = "content-length" not in headers and (
                te.rsplit(",", 1)[-1].strip().lower() != "chunked"
            )
        head = self.head
        if not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.got.append(body)

    def on_message_complete(self) -> None:
        if self.headed:
            self.complete = True

    # -- handing pieces on ----------------------------------------------------------

    def _deliver(self, piece: bytes) -> None:
        sink = self.sink
        if sink is not None and not self.pieces:
            sink(piece)
            return
        self.pieces.append(piece)
        self.buffered += len(piece)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _fail(self, err: UpstreamError) -> None:
        if self.error is None:
            self.error = err
        if self.head is not None and not self.head.done():
            self.head.set_exception(err)
            self.head.exception()  # retrieved: nobody else may be waiting on it
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- for the Response --------------------------------------------------------------

    async def next_piece(self) -> bytes | None:
        while not self.pieces:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            await self.wait()
        return self.take()

    async def wait(self) -> None:
        """Until the next piece, the body's end, a failure or detach()."""
        self.waiter = self.loop.create_future()
        await self.waiter
        self.waiter = None

    def detach(self) -> None:
        """Pieces wait for next_piece again; the task in Response.push goes on."""
        self.sink = None
        self._wake()

    def take(self) -> bytes:
        """Every piece that has come, as one: one pass through the relay and one write
        to the client, not one per engine write; reading resumes if it had paused."""
        pieces = self.pieces
        piece = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.buffered -= len(piece)
        if self.paused and self.buffered < _HIGH_WATER // 2 and self.transport:
            self.paused = False
            self.transport.resume_reading()
        return piece

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
            self.transport = None


# Idle connections kept per engine: after a burst of thousands of requests, the rest
# are closed rather than held open on both sides.
MAX_IDLE = 256


class Response:
    __slots__ = ("conn", "status", "headers", "_pool", "_released")

    def __init__(self, conn: Connection, pool: "Pool"):
        self.conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._pool = pool
        self._released = False

    async def next(self) -> bytes | None:
        """The next piece of the body as it arrived (chunk framing removed); None at end."""
        return await self.conn.next_piece()

    async def push(self, sink) -> None:
        """Hand each piece of the body to `sink` as it arrives, called from the engine
        connection's own callback (no task woken a piece), until the body ends, the
        connection fails or the sink calls detach(); then next() takes what remains
        or raises the failure. `sink` must not raise. Nothing is pushed while pieces
        wait to be taken: they would go out of order."""
        conn = self.conn
        if conn.pieces:
            return
        conn.sink = sink
        try:
            while conn.sink is not None and not conn.complete and conn.error is None:
                await conn.wait()
        finally:
            conn.sink = None

    def detach(self) -> None:
        self.conn.detach()

    def whole(self) -> bytes | None:
        """The whole body if it has all come already (the usual answer from an engine
        on loopback), taken without waiting; None if not."""
        conn = self.conn
        if not conn.complete or conn.error is not None:
            return None
        return conn.take()

    async def read(self) -> bytes:
        parts = []
        while (piece := await self.conn.next_piece()) is not None:
            parts.append(piece)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: keep the connection for the next request if we can."""
        if self._released:
            return
        self._released = True
        conn = self.conn
        self._pool.busy.discard(conn)
        origin = conn.origin
        if conn.reusable() and not origin.retired and len(origin.idle) < MAX_IDLE:
            conn._reset()
            origin.idle.append(conn)
            origin.wake_one()
        else:
            conn.close()


def dead_after(sock, seconds: float) -> None:
    """Give a connection up once its peer's host has not answered for about `seconds`.

    An engine cut off by a partition sends nothing, not even a reset: a whole answer's
    wait would last upstream_timeout_s (minutes), though nothing had reached the client
    and another replica could answer. TCP keepalive probes (the first after seconds/2 of
    silence, then every seconds/6, three unanswered) and TCP_USER_TIMEOUT (data sent and
    not acknowledged for `seconds`) find the path dead; the connection then fails, and
    the request is retried elsewhere if nothing of it reached the client. A slow engine
    is not dead: its kernel answers the probes while it computes."""
    if sock is None or seconds <= 0:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(seconds / 2)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(seconds / 6)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
    except OSError:
        pass  # not TCP (a test's socket pair): nothing to probe


class Pool:
    """Kept-alive connections per origin; a request takes one or opens a new one."""

    def __init__(self, connect_timeout: float = 3.0, total_timeout: float = 600.0,
                 max_conns: int = 1024, dead_s: float = 10.0):  # fmt: skip
        self.connect_timeout = connect_timeout
        self.total_timeout = total_timeout
        self.dead_s = dead_s  # an engine silent this long, and its host too: see dead_after
        # Connections to one engine at most: past it, a request waits for one to come
        # free. An engine answers a few requests at once (its slots) and queues the
        # rest anyway; this keeps a burst of clients from costing a file descriptor
        # each on both sides.
        self.max_conns = max_conns
        self._origins: dict[str, Origin] = {}
        self._ssl = None
        self.busy: set[Connection] = set()  # requests under way, for the sweep
        self._sweeper: asyncio.TimerHandle | None = None

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin(url)
        return origin

    def retain(self, urls) -> None:
        """Forget every origin not in `urls` (the endpoints of a new routing table) and
        close its idle connections; one still answering closes when its response ends.
        Without this, every replica that ever served kept an entry, and its kept-alive
        connections, for the router's life."""
        keep = set(urls)
        for url in [u for u in self._origins if u not in keep]:
            origin = self._origins.pop(url)
            origin.retired = True
            while origin.idle:
                origin.idle.pop().close()

    async def _connect(self, origin: Origin) -> Connection:
        origin.open += 1  # held for this connection from now; given back if it fails
        try:
            conn = await self._open(origin)
        except BaseException:
            origin.closed_one()
            raise
        if conn.transport is None:  # lost already, before it could hold the place
            origin.closed_one()
        else:
            conn.counted = True  # its connection_lost gives the place back
        return conn

    async def _open(self, origin: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        ssl = None
        if origin.ssl:
            ssl = self._ssl = self._ssl or ssl_module.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(origin), origin.host, origin.port, ssl=ssl
                )
        except TimeoutError:
            raise UpstreamError(
                "timeout",
                f"connecting to {origin.host}:{origin.port} took over {self.connect_timeout:g}s",
            ) from None
        except OSError as e:
            kind = "local" if e.errno in _LOCAL_ERRNOS else "connect"
            raise UpstreamError(
                kind, f"cannot connect to {origin.host}:{origin.port}: {e.strerror or e}"
            ) from None
        if conn.transport is not None:
            dead_after(conn.transport.get_extra_info("socket"), self.dead_s)
        return conn

    async def request(self, origin: Origin, head: bytes, body: bytes) -> Response:
        """Send `head` (request line and headers, without Host, Content-Length or the
        blank line) and `body`; return once the response's status and headers are in."""
        data = b"".join(
            (
                head,
                b"Host: ",
                origin.host_header,
                b"\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
                body,
            )
        )
        while True:
            while origin.idle:
                conn = origin.idle.pop()
                if conn.transport is None or conn.transport.is_closing():
                    continue
                try:
                    return await self._exchange(conn, data)
                except UpstreamError as e:
                    # A kept-alive connection the engine had already closed: nothing was
                    # processed, so try again on another connection.
                    if e.kind != "closed" or conn.got_bytes:
                        raise
            if origin.open < self.max_conns:
                return await self._exchange(await self._connect(origin), data)
            # As many connections as allowed are busy: wait for one to come free.
            waiter = asyncio.get_running_loop().create_future()
            origin.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    origin.wake_one()  # woken, then cancelled: pass the turn on
                raise

    async def _exchange(self, conn: Connection, data: bytes) -> Response:
        loop = conn.loop
        conn.head = loop.create_future()
        conn.deadline = loop.time() + self.total_timeout
        self.busy.add(conn)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self._sweep_s(), self._sweep, loop)
        try:
            conn.transport.write(data)
            await conn.head
        except BaseException:
            self.busy.discard(conn)
            conn.close()
            raise
        return Response(conn, self)

    def _sweep_s(self) -> float:
        return min(1.0, self.total_timeout / 4)

    def _sweep(self, loop) -> None:
        """Fail every request past its deadline; look again while any is under way."""
        now = loop.time()
        for conn in [c for c in self.busy if c.deadline <= now]:
            self.busy.discard(conn)
            conn._fail(UpstreamError("timeout", f"the engine took over {self.total_timeout:g}s"))
            conn.close()
        self._sweeper = loop.call_later(self._sweep_s(), self._sweep, loop) if self.busy else None

    def close(self) -> None:
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
