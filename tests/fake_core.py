"""The router's request path in the test's own process: the real Proxy, policies, limits,
admission and routing table, over hand-written fakes of what it talks to.

- `Engines`, the pool: each engine (by url) answers every API natively or only OpenAI's
  (404 on /v1/messages and /v1/responses, so the router translates to chat), whole or
  streamed in pieces cut at any byte, and fails as told: refused, a status, a body that
  breaks before its first event or after some, a stream without its end event.
- `Request` and `Client`: a client's request, and its end of a streamed answer.
- `Rows`, the usage writer; `Core`, the whole path put together, with a fake clock.

Nothing here sleeps or opens a socket (tests/fake_engine.py is the subprocess engine;
the native Messages and Responses shapes are its own, so the two speak alike).
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from multidict import CIMultiDict

from llmgw import apikeys
from llmgw import config as configmod
from llmgw_router import dialects
from llmgw_router.admission import Admission
from llmgw_router.conversations import Conversations
from llmgw_router.exchange import Answer
from llmgw_router.keycache import KeyCache
from llmgw_router.limits import Limiter
from llmgw_router.policy import Policies, State
from llmgw_router.proxy import Proxy
from llmgw_router.quota import Quota
from llmgw_router.routes import Route
from llmgw_router.routing import Endpoint, RoutingTable
from llmgw_router.upstream import UpstreamError
from tests.fake_engine import Messages, Responses

WORDS = ["The", " quick", " brown", " fox", " jumps"]

# How the next request to an engine fails (Engine.fail, Engines.fail_next); a status
# (an int) is answered as that status.
REFUSE = "refused"  # the connection is refused
EMFILE = "emfile"  # the router itself has no file descriptor left
BREAK_BEFORE = "breaks before its first event"  # status 200, then part of one event, reset
BREAK_AFTER = "breaks after its first events"  # two content events, part of a third, reset
NO_END = "ends without its end event"  # everything, the end event without its blank line


# -- what each API's answers look like on the wire ---------------------------------------


def _split(data: bytes) -> list[bytes]:
    """LF-framed events, each with its blank line."""
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


class _OpenAI:
    """Chat completions and completions, as llama-server answers them (its chat stream
    opens with a chunk that only says the role, as tests/fixtures/chat_streams records)."""

    def __init__(self, path: str, kind: str):
        self.path, self.kind = path, kind

    def _choice(self, text, finish=None, whole: bool = False, role: bool = False) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "finish_reason": finish}
        said = {"content": text}
        if whole or role:
            said["role"] = "assistant"
        return {"index": 0, "message" if whole else "delta": said, "finish_reason": finish}

    def whole(self, model: str, text: str, usage: dict) -> dict:
        return {"id": "cmpl-1", "object": self.kind, "created": 0, "model": model,
                "choices": [self._choice(text, "stop", whole=True)], "usage": usage}  # fmt: skip

    def stream(self, model, pieces, usage, body) -> tuple[list, list, list]:
        kind = self.kind if self.kind == "text_completion" else "chat.completion.chunk"

        def chunk(**fields) -> bytes:
            data = {"id": "cmpl-1", "object": kind, "created": 0, "model": model, **fields}
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        head = [] if kind == "text_completion" else [chunk(choices=[self._choice(None, role=True)])]
        deltas = [chunk(choices=[self._choice(p)]) for p in pieces]
        tail = [chunk(choices=[self._choice("", "stop")])]
        if (body.get("stream_options") or {}).get("include_usage"):
            tail.append(chunk(choices=[], usage=usage))
        return head, deltas, [*tail, b"data: [DONE]\n\n"]


class _Native:
    """Another API as llama-server serves it natively (tests/fake_engine.py's shapes)."""

    def __init__(self, path: str, shapes):
        self.path, self.shapes = path, shapes

    def whole(self, model: str, text: str, usage: dict) -> dict:
        return self.shapes.whole(model, text, usage)

    def stream(self, model, pieces, usage, body) -> tuple[list, list, list]:
        s = self.shapes
        head = _split(s.head(model, usage))
        tail = _split(s.tail(model, "".join(pieces), usage))
        return head, [s.delta(p) for p in pieces], tail


APIS = {
    api.path: api
    for api in (
        _OpenAI("/v1/chat/completions", "chat.completion"),
        _OpenAI("/v1/completions", "text_completion"),
        _Native("/v1/messages", Messages),
        _Native("/v1/responses", Responses),
    )
}
OPENAI_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))


# -- the pool ---------------------------------------------------------------------------


@dataclass
class Engine:
    """One engine: what it answers, and how it always fails (None: it does not)."""

    native: bool = True  # serves /v1/messages and /v1/responses (else 404 on them)
    fail: object = None
    pieces: list[str] = field(default_factory=lambda: list(WORDS))
    usage: tuple[int, int] | None = None  # (prompt, completion); None: (7, one a piece)
    cut: int = 0  # a streamed body in pieces of this many bytes (0: a piece an event)
    hold: asyncio.Event | None = None  # answers once this is set
    model: str = "/weights/m.gguf"  # what it says as `model`, as llama-server does


class Reply:
    """An engine's response (upstream.Response): `pieces` of its body as they come,
    then `then` (an UpstreamError) or the end."""

    def __init__(self, status: int, pieces: list[bytes], content_type: str, then=None):
        self.status = status
        self.headers = {"content-type": content_type}
        self._pieces, self._then = list(pieces), then
        self._detached = False
        self.released = 0

    def whole(self) -> bytes | None:
        if self._then is not None:
            return None  # not all here (nor will it be): read() says why
        body, self._pieces = b"".join(self._pieces), []
        return body

    async def read(self) -> bytes:
        parts = []
        while (piece := await self.next()) is not None:
            parts.append(piece)
        return b"".join(parts)

    async def next(self) -> bytes | None:
        await asyncio.sleep(0)  # as a socket would: others run between pieces
        if self._pieces:
            return self._pieces.pop(0)
        if self._then is not None:
            raise self._then
        return None

    async def push(self, sink) -> None:
        """The fast path (upstream.Response.push): pieces to `sink` until detached."""
        self._detached = False
        while self._pieces and not self._detached:
            sink(self._pieces.pop(0))

    def detach(self) -> None:
        self._detached = True

    def release(self) -> None:
        self.released += 1


class Sent(NamedTuple):
    url: str
    path: str
    body: dict
    head: bytes = b""  # the request line and headers, as the router sent them


class Engines:
    """The pool: each engine (by url, `how`) answers as told; `fail_next` fails the next
    requests an engine would answer, in turn, whichever engine gets them (refusals and
    statuses fail any request; the rest, only one on a path the engine serves). What
    each was sent is kept, and every reply it gave."""

    def __init__(self, default: Engine | None = None):
        self.how: dict[str, Engine] = {}
        self.default = default or Engine()
        self.fail_next: list = []
        self.sent: list[Sent] = []
        self.failed: list[Sent] = []  # the requests that failed as told
        self.replies: list[Reply] = []

    def origin(self, url: str) -> str:
        return url

    def engine(self, url: str) -> Engine:
        return self.how.setdefault(url, Engine(**vars(self.default)))

    async def request(self, origin: str, head: bytes, body: bytes) -> Reply:
        path = head.split(b" ", 2)[1].decode()
        payload = json.loads(body)
        self.sent.append(Sent(origin, path, payload, head))
        engine = self.engine(origin)
        if engine.hold is not None:
            await engine.hold.wait()
        serves = path in OPENAI_PATHS or (engine.native and path in APIS)
        fail = engine.fail if engine.fail is not None else next(iter(self.fail_next), None)
        if not (serves or fail in (REFUSE, EMFILE) or isinstance(fail, int)):
            fail = None  # a path it lacks is answered 404 first; the failure waits
        elif fail is not None:
            if engine.fail is None:
                self.fail_next.pop(0)
            self.failed.append(self.sent[-1])
        if fail == REFUSE:
            raise UpstreamError("connect", f"cannot connect to {origin}")
        if fail == EMFILE:
            raise UpstreamError("local", f"cannot connect to {origin}: Too many open files")
        if isinstance(fail, int):
            return self._reply(fail, error_body(fail, "overloaded"))
        if not serves:  # llama-server's answer on a path it lacks
            return self._reply(404, error_body(404, "File Not Found"))
        return self._answer(engine, APIS[path], payload, fail)

    def _reply(self, status, body: bytes, ctype="application/json", then=None) -> Reply:
        pieces = [body] if isinstance(body, bytes) else body
        reply = Reply(status, pieces, ctype, then)
        self.replies.append(reply)
        return reply

    def _answer(self, engine: Engine, api, payload: dict, fail) -> Reply:
        prompt, completion = engine.usage or (7, len(engine.pieces))
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}  # fmt: skip
        reset = UpstreamError("read", "connection reset by peer")
        if not payload.get("stream"):
            body = json.dumps(api.whole(engine.model, "".join(engine.pieces), usage)).encode()
            if fail == BREAK_BEFORE:
                return self._reply(200, [body[: len(body) // 2]], then=reset)
            return self._reply(200, body)
        head, deltas, tail = api.stream(engine.model, engine.pieces, usage, payload)
        events, then = [*head, *deltas, *tail], None
        if fail == BREAK_BEFORE:
            events, then = [events[0][: len(events[0]) // 2]], reset
        elif fail == BREAK_AFTER:
            cut = len(head) + 2
            events, then = [*events[:cut], events[cut][: len(events[cut]) // 2]], reset
        elif fail == NO_END:
            events[-1] = events[-1][:-1]  # its last line ended, but no blank line after
        data = b"".join(events)
        if engine.cut:
            pieces = [data[i : i + engine.cut] for i in range(0, len(data), engine.cut)]
        else:
            pieces = [e for e in events if e]
        return self._reply(200, pieces, "text/event-stream", then)


def error_body(status: int, message: str) -> bytes:
    kind = "server_error" if status >= 500 else "not_found_error"
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}).encode()


# -- the client ---------------------------------------------------------------------------


class Client:
    """The client's end of a streamed answer, as the aiohttp transport's (no push): its
    head, the bytes it was sent, whether it was ended."""

    def __init__(self, status: int, headers: dict):
        self.status, self.headers = status, headers
        self.body = bytearray()
        self.ended = False
        self.after_end = b""  # anything written after the end (there must be nothing)
        self.writes = 0  # writes the body took (its end included)

    async def write(self, data: bytes, last: bool = False) -> None:
        self._take(data)
        self.writes += 1
        if last:
            self.ended = True

    async def write_eof(self) -> None:
        if not self.ended:
            self.writes += 1
        self.ended = True

    def _take(self, data: bytes) -> None:
        if self.ended:
            self.after_end += data
        else:
            self.body += data


class PushingClient(Client):
    """A client stream with push/drain (as http1's): pieces relayed from the engine
    connection's callback, and one push in three says the client is slow to read."""

    pushed = 0

    def push(self, data: bytes, last: bool = False) -> bool:
        self._take(data)
        self.writes += 1
        if last:
            self.ended = True
        self.pushed += 1
        return self.pushed % 3 != 0

    async def drain(self) -> None:
        await asyncio.sleep(0)


class Request:
    """A client's request as the core reads one (exchange.py)."""

    def __init__(self, secret: str, body: dict, path: str, app: dict, client=Client):
        self.headers = CIMultiDict({"Authorization": f"Bearer {secret}"})
        self.body = json.dumps(body).encode()
        self.content_length = len(self.body)
        self.method, self.path, self.app = "POST", path, app
        self.query, self.match_info, self.values = {}, {}, {}
        self.client_class = client
        self.client: Client | None = None  # once a stream was opened

    async def read(self) -> bytes:
        return self.body

    def get(self, name, default=None):
        return self.values.get(name, default)

    def __setitem__(self, name, value) -> None:
        self.values[name] = value

    async def open_stream(self, status: int, headers: dict) -> Client:
        assert self.client is None, "one stream a request"
        self.client = self.client_class(status, headers)
        return self.client


@dataclass
class Got:
    """What the client received: a whole answer, or a stream (`streamed`) and whether
    it was ended."""

    status: int
    headers: dict
    body: bytes
    streamed: bool
    ended: bool


# -- the request path ----------------------------------------------------------------------


class Rows:
    """The usage writer: every row recorded, and what `watch()` said as it was (what
    the client had been sent by then, say)."""

    def __init__(self):
        self.rows = []
        self.seen = []
        self.watch = lambda: None

    def record(self, row) -> None:
        self.rows.append(row)
        self.seen.append(self.watch())


def models(*defs: dict) -> list:
    return [configmod.model_from({"source": f"/models/{d['name']}.gguf", **d}) for d in defs]


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Core:
    """One router's request path over `endpoints` and `catalog`, with keys made by
    `key`; `slots` bounds a model's requests at once (admission)."""

    def __init__(self, endpoints: list[Endpoint], catalog: list, slots: dict | None = None,
                 engine: Engine | None = None, keepalive_s: float = 3600.0):  # fmt: skip
        self.clock = Clock()
        self.limiter = Limiter()
        self.policies = Policies(self.limiter, ["gold", "bronze"], "bronze", models=catalog)
        self.policies.loaded.set()
        self.keys = KeyCache()
        self.keys.loaded.set()
        self.table = RoutingTable(endpoints, cooldown_s=5.0)
        self.engines = Engines(engine)
        self.usage = Rows()
        slots = slots or {}
        self.admission = Admission(self.policies.bands, slots.get, clock=self.clock)
        self.proxy = Proxy(
            self.table, self.keys, self.usage, self.engines, 1 << 20, retries=2,
            keepalive_interval_s=keepalive_s, policies=self.policies,
            quota=Quota(self.limiter, None, 0.0, 256), admission=self.admission,
        )  # fmt: skip
        self.conversations = Conversations(None)  # no store: what is kept stays in memory
        self.app = {"proxy": self.proxy, "conversations": self.conversations}
        self._rows = []

    def key(self, name: str, band: str = "", budget_cost: float | None = None) -> str:
        secret = f"sk-{name}"
        row = type("Row", (), dict(
            id=f"key_{name}", secret_hash=apikeys.hash_secret(secret), model_list=[],
            expires_at=None, user=None, project=None, band=band, revoked_at=None,
            updated_at=time.time()))  # fmt: skip
        self._rows.append(row)
        self.keys.apply(self._rows)
        if budget_cost is not None:
            st = self.policies.state
            budgets = {**st.budgets, ("key", row.id): [("month", None, budget_cost)]}
            self.policies.state = State(st.users, st.projects, st.limits, budgets, st.models)
            self.policies.generation += 1
            for c in self.costs(secret):  # this router holds the whole budget
                now = time.time()
                c.roll(now)
                self.limiter.granted(c, c.window, c.limit, c.limit, False, now)
        return secret

    def costs(self, secret: str) -> list:
        """The cost budgets that apply to the key."""
        return self.policies.policy(self.keys.lookup(secret)).costs

    async def handle(self, route: Route, request: Request) -> Answer:
        """The route's handler, as the router serves it (app.py)."""
        if route.api.translate is not None:
            return await dialects.handler(route)(request)
        return await self.proxy.forward(request, route)

    def request(self, route: Route, secret: str, body: dict, client=Client) -> Request:
        return Request(secret, body, route.path, self.app, client)

    async def send(self, route: Route, request: Request) -> Got:
        """What the client got for `request`."""
        resp = await self.handle(route, request)
        if isinstance(resp, Answer):
            assert request.client is None, "a whole answer after the stream was opened"
            return Got(resp.status, resp.headers, resp.body, False, True)
        assert resp is request.client
        assert not resp.after_end, f"written after the stream's end: {resp.after_end!r}"
        return Got(resp.status, resp.headers, bytes(resp.body), True, resp.ended)

    async def ask(self, route: Route, secret: str, body: dict, client=Client) -> Got:
        return await self.send(route, self.request(route, secret, body, client))
