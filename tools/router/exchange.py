"""The request path's own view of HTTP: a request, a whole answer, and a stream.

The core (proxy.py, call.py, the dialects and the Responses API) is written against
these and imports no server. A transport (http1.py, the default; aiohttp_app.py, the
fallback) turns bytes on a socket into a Request, and an Answer or a Stream back into
bytes. What a handler returns is either an Answer, not yet sent, or the Stream it
opened and wrote (already on its way to the client).

What the core reads of a request, whichever transport made it:
- method, path (no query), query (a mapping), headers (a case-insensitive mapping),
  match_info (the path's named parts), content_length (None when not given);
- app: the router's shared state (proxy, conversations, ...);
- `await read()`: the whole body (BodyTooLarge past the limit);
- `await open_stream(status, headers)`: send the head, get a Stream;
- `get(name)` / `[name] = value`: per-request values the core hands itself.
"""

import json


def loads(data: bytes):
    """json.loads of an HTTP body. UTF-8, what JSON on the wire is, is decoded at once
    (json.loads of bytes first sniffs among UTF-8, -16 and -32, a cost on every
    request); anything else is left to json.loads as before."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return json.loads(data)
    return json.loads(text)


class BodyTooLarge(Exception):
    """The request body is over the router's limit (router.max_body_bytes)."""


class Answer:
    """A whole answer, not yet sent: status, headers (written as given) and body."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int = 200, body: bytes = b"", headers: dict | None = None):
        self.status = status
        self.body = body
        self.headers = headers if headers is not None else {}

    def __repr__(self) -> str:
        return f"Answer({self.status}, {len(self.body)} bytes)"


def json_answer(obj, status: int = 200, headers: dict | None = None) -> Answer:
    """`obj` as a JSON answer."""
    out = {"Content-Type": "application/json"}
    if headers:
        out.update(headers)
    return Answer(status, json.dumps(obj).encode(), out)


class Stream:
    """What a transport's Request.open_stream gives: the answer's head has gone to the
    client; its body goes in pieces. `write` waits while the client is slow to read
    (so the engine is read no faster than the client reads) and raises ConnectionError
    once the client has gone."""

    status: int
    headers: dict

    async def write(self, data: bytes, last: bool = False) -> None:  # pragma: no cover
        """`last`: the body ends with `data` (in the same write, where the transport can:
        a stream that arrives whole then costs one write, not two)."""
        raise NotImplementedError

    async def write_eof(self) -> None:  # pragma: no cover - an interface
        raise NotImplementedError
