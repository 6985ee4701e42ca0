"""A fast fake OpenAI-compatible engine for the benchmark, on raw asyncio Protocols (uvloop).

    python bench/fake_engine.py --port 8011 [--chunks 20] [--gap-ms 0]

POST /v1/chat/completions answers a small fixed completion (with `usage`), or with
`"stream": true` a `--chunks`-chunk SSE stream, `--gap-ms` apart so that a proxy sees
each chunk as its own read (as with a real engine), then a usage chunk when
`stream_options.include_usage` is true, then `data: [DONE]`. POST /v1/messages answers a
fixed Anthropic message, as an engine that serves that API itself (404 with --chat-only,
so the router translates). GET /health answers 200.
HTTP/1.1 keep-alive throughout: Content-Length for plain answers, chunked for streams.
"""

import argparse
import asyncio
import json

import uvloop

MODEL = "bench"
_CREATED = 1_700_000_000


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _plain(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    )
    return head.encode() + body


USAGE = {"prompt_tokens": 9, "completion_tokens": 20, "total_tokens": 29}
COMPLETION = _plain(
    "200 OK",
    _json(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": _CREATED,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello from the fake engine!"},
                    "finish_reason": "stop",
                }
            ],
            "usage": USAGE,
        }
    ),
)
# Anthropic's Messages API answered natively (as llama-server does), unless --chat-only.
MESSAGE = _plain(
    "200 OK",
    _json(
        {
            "id": "msg_bench",
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [{"type": "text", "text": "Hello from the fake engine!"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 9, "output_tokens": 20},
        }
    ),
)
HEALTH = _plain("200 OK", b'{"status":"ok"}')
MODELS = _plain("200 OK", _json({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
NOT_FOUND = _plain("404 Not Found", b'{"error":{"message":"not found"}}')
BAD_REQUEST = _plain("400 Bad Request", b'{"error":{"message":"bad request"}}')
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(delta: dict, finish=None, choices=True, usage=None) -> bytes:
    obj = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": _CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else [],
    }
    if usage is not None:
        obj["usage"] = usage
    return _chunk(b"data: " + _json(obj) + b"\n\n")


def stream_events(n: int) -> list[bytes]:
    """The n content events of a stream: the first carries the role, the last the finish."""
    events = []
    for i in range(n):
        delta = {"role": "assistant", "content": "tok"} if i == 0 else {"content": f" tok{i}"}
        events.append(_event(delta, finish="stop" if i == n - 1 else None))
    return events


USAGE_EVENT = _event({}, choices=False, usage=USAGE)
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class EngineProtocol(asyncio.Protocol):
    """One client connection: requests are answered in order, one at a time."""

    def __init__(self, events: list[bytes], gap_s: float, messages: bool = True):
        self.events, self.gap_s, self.messages = events, gap_s, messages
        self.buf = bytearray()
        self.transport = None
        self.streaming = False

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.transport = None

    def data_received(self, data):
        self.buf += data
        if not self.streaming:
            self.process()

    def process(self):
        while self.transport is not None and not self.streaming:
            request = self.take_request()
            if request is None:
                return
            self.answer(*request)

    def take_request(self):
        """(method, path, body) of the next complete request in the buffer, or None."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = bytes(self.buf[:end]).split(b"\r\n")
        method, path, _ = lines[0].split(b" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body, used = _dechunk(self.buf, start)
            if body is None:
                return None
            del self.buf[:used]
            return method, path, body
        length = int(headers.get(b"content-length", b"0"))
        if len(self.buf) < start + length:
            return None
        body = bytes(self.buf[start : start + length])
        del self.buf[: start + length]
        return method, path, body

    def answer(self, method: bytes, path: bytes, body: bytes):
        path = path.split(b"?", 1)[0]
        if method == b"GET" and path == b"/health":
            self.transport.write(HEALTH)
        elif method == b"GET" and path == b"/v1/models":
            self.transport.write(MODELS)
        elif method == b"POST" and path == b"/v1/chat/completions":
            try:
                req = json.loads(body)
            except ValueError:
                self.transport.write(BAD_REQUEST)
                return
            if req.get("stream"):
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                self.streaming = True
                asyncio.get_running_loop().create_task(self.stream(usage))
            else:
                self.transport.write(COMPLETION)
        elif method == b"POST" and path == b"/v1/messages" and self.messages:
            self.transport.write(MESSAGE)
        else:
            self.transport.write(NOT_FOUND)

    async def stream(self, usage: bool):
        try:
            self.transport.write(STREAM_HEAD)
            for event in self.events:
                if self.transport is None:
                    return
                self.transport.write(event)
                if self.gap_s:
                    await asyncio.sleep(self.gap_s)
            if self.transport is None:
                return
            if usage:
                self.transport.write(USAGE_EVENT)
            self.transport.write(DONE)
        finally:
            self.streaming = False
        self.process()


def _dechunk(buf: bytearray, pos: int):
    """(body, bytes used) of a chunked body starting at pos, or (None, 0) if incomplete."""
    body = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None, 0
        size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n", pos)  # no trailers expected: just the final CRLF
            return (bytes(body), end + 2) if end >= 0 else (None, 0)
        if len(buf) < pos + size + 2:
            return None, 0
        body += buf[pos : pos + size]
        pos += size + 2


async def serve(host: str, port: int, chunks: int, gap_ms: float, messages: bool = True):
    loop = asyncio.get_running_loop()
    events = stream_events(chunks)
    server = await loop.create_server(
        lambda: EngineProtocol(events, gap_ms / 1000, messages), host, port, backlog=1024
    )
    async with server:
        await server.serve_forever()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per stream")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="pause between chunks")
    parser.add_argument(
        "--chat-only", action="store_true", help="answer /v1/messages 404, as vLLM may"
    )
    args = parser.parse_args()
    try:
        uvloop.run(serve(args.host, args.port, args.chunks, args.gap_ms, not args.chat_only))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
