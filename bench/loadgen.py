"""A small, low-overhead HTTP/1.1 load generator on raw asyncio Protocols.

Each of `concurrency` keep-alive connections sends one request at a time and times it:
total latency, and time to the first body byte (for streams: the first SSE chunk).
Runs stop after `count` requests or `max_s` seconds, whichever comes first.
"""

import asyncio
import json
import time
from dataclasses import dataclass, field

CHAT_PATH = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say hello in five words."}]


def chat_body(stream: bool) -> bytes:
    body = {"model": "bench", "messages": MESSAGES, "max_tokens": 20}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


def messages_body(model: str) -> bytes:
    """An Anthropic Messages request asking what chat_body asks."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": 20}
    return json.dumps(body, separators=(",", ":")).encode()


def raw_request(host: str, port: int, path: str, body: bytes, api_key: str = "") -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Response:
    __slots__ = ("status", "body", "first_body_at", "done_at", "close")

    def __init__(self, status, body, first_body_at, done_at, close):
        self.status, self.body = status, body
        self.first_body_at, self.done_at = first_body_at, done_at
        self.close = close  # the server said `Connection: close`


class ClientProtocol(asyncio.Protocol):
    """One keep-alive connection that parses Content-Length, chunked and close-delimited
    responses incrementally."""

    def __init__(self):
        self.transport = None
        self.waiter: asyncio.Future | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.reset()

    def reset(self):
        self.buf = bytearray()
        self.status = 0
        self.head_end = -1
        self.length = -1  # -1: chunked, -2: until close
        self.pos = 0  # chunked: where the next chunk-size line starts
        self.body = bytearray()
        self.first_body_at = 0.0
        self.close = False

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)
        if self.waiter is not None and not self.waiter.done():
            if self.head_end >= 0 and self.length == -2:
                self.finish(time.perf_counter())
            else:
                self.waiter.set_exception(ConnectionError("connection closed by the server"))

    def request(self, raw: bytes) -> asyncio.Future:
        self.reset()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter

    def finish(self, now: float):
        response = Response(
            self.status, bytes(self.body), self.first_body_at or now, now, self.close
        )
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def data_received(self, data):
        now = time.perf_counter()
        self.buf += data
        if self.head_end < 0 and not self.parse_head():
            return
        if self.length >= 0:
            if len(self.buf) > self.head_end and not self.first_body_at:
                self.first_body_at = now
            if len(self.buf) >= self.head_end + self.length:
                self.body = self.buf[self.head_end : self.head_end + self.length]
                self.finish(now)
        elif self.length == -1:
            self.parse_chunks(now)
        else:
            if not self.first_body_at and len(self.buf) > self.head_end:
                self.first_body_at = now
            self.body = self.buf[self.head_end :]

    def parse_head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.buf[:end]).split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        self.length = -2
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self.length = -1
            elif name == b"connection" and value.strip().lower() == b"close":
                self.close = True
        self.head_end = self.pos = end + 4
        return True

    def parse_chunks(self, now: float):
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n", self.pos)
            if eol < 0:
                return
            size = int(bytes(buf[self.pos : eol]).split(b";")[0], 16)
            if size and not self.first_body_at:
                self.first_body_at = now
            start = eol + 2
            if size == 0:
                if buf.find(b"\r\n", start) >= 0:
                    self.finish(now)
                return
            if len(buf) < start + size + 2:
                return
            self.body += buf[start : start + size]
            self.pos = start + size + 2


@dataclass
class Result:
    """What a run measured; times in seconds."""

    requests: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    first_error: str = ""

    @property
    def ok(self) -> int:
        return self.requests - self.errors


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0-100), nearest-rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


async def run(
    host: str,
    port: int,
    raw: bytes,
    count: int,
    concurrency: int,
    max_s: float,
    stream: bool = False,
) -> Result:
    """Send `count` requests over `concurrency` connections, within `max_s` seconds."""
    loop = asyncio.get_running_loop()
    result = Result()
    started = time.perf_counter()
    deadline = started + max_s
    issued = 0

    def good(response: Response) -> str:
        if response.status != 200:
            return f"HTTP {response.status}: {response.body[:200]!r}"
        if stream and b"data: [DONE]" not in response.body:
            return f"stream without [DONE]: {response.body[-200:]!r}"
        if not stream and b'"usage"' not in response.body:
            return f"answer without usage: {response.body[:200]!r}"
        return ""

    async def worker():
        nonlocal issued
        conn = None
        while issued < count and time.perf_counter() < deadline:
            issued += 1
            try:
                if conn is None or conn.transport is None:
                    _, conn = await loop.create_connection(ClientProtocol, host, port)
                sent = time.perf_counter()
                response = await asyncio.wait_for(conn.request(raw), timeout=30)
            except (TimeoutError, OSError) as e:
                result.requests += 1
                result.errors += 1
                result.first_error = result.first_error or f"{type(e).__name__}: {e}"
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
                conn = None
                continue
            result.requests += 1
            if response.close:
                conn.transport.close()
                conn = None
            problem = good(response)
            if problem:
                result.errors += 1
                result.first_error = result.first_error or problem
            else:
                result.latencies.append(response.done_at - sent)
                result.ttfbs.append(response.first_body_at - sent)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - started
    return result
