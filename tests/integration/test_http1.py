"""The router's own HTTP/1.1 server (http1.py) against raw sockets: pipelining, chunked
bodies, 100-continue, limits, slow clients, HTTP/1.0, Connection: close, a client that
stops reading, and fuzzed bytes. The real router executable and the fake engine."""

import json
import os
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_engine import WORDS
from tests.helpers import eventually
from tests.integration.conftest import CHAT
from tests.rawhttp import Conn, chunked, request

MAX_BODY = 64 * 1024


@pytest.fixture
def server(make_router, engine):
    return make_router(
        [engine.url],
        max_body_bytes=MAX_BODY,
        max_url_bytes=1024,
        max_header_bytes=4096,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        idle_timeout_s=60.0,
    )


@pytest.fixture
def connect(server):
    """Connections to the router, closed after the test."""
    made = []

    def make(timeout: float = 10.0) -> Conn:
        made.append(Conn(server.url, timeout))
        return made[-1]

    yield make
    for c in made:
        c.close()


def auth(router) -> dict:
    return {"Authorization": f"Bearer {router.secret}", "Content-Type": "application/json"}


def chat(router, **extra) -> bytes:
    body = json.dumps({**CHAT, **extra}).encode()
    return request("POST", "/v1/chat/completions", body, auth(router))


def test_pipelined_requests_are_answered_in_order(server, connect):
    c = connect()
    c.send(
        chat(server, max_tokens=3)
        + request("GET", "/health")
        + chat(server, stream=True)
        + request("GET", "/no/such/path", headers=auth(server))
        + request("GET", "/v1/models", headers=auth(server))
    )
    a, b, s, d, e = c.read(5)
    assert a.status == 200 and a.json()["object"] == "chat.completion"
    assert b.status == 200 and b.json()["status"] == "ok"
    assert s.status == 200 and s.headers["content-type"] == "text/event-stream"
    assert s.body.rstrip().endswith(b"data: [DONE]")
    assert d.status == 404 and d.json()["error"]["code"] == "unknown_url"
    assert e.status == 200 and e.json()["data"][0]["id"] == "m"
    assert all(r.keep_alive for r in (a, b, s, d, e))


def test_more_pipelined_requests_than_are_queued_at_once_are_all_answered(server, connect):
    """Past 8 queued, the router stops reading the connection until the queue shortens:
    nothing is lost or reordered."""
    c = connect()
    c.send(b"".join(chat(server, max_tokens=n) if n % 3 == 0 else request("GET", "/health")
                    for n in range(30)))  # fmt: skip
    replies = c.read(30)
    assert [r.status for r in replies] == [200] * 30
    for n, r in enumerate(replies):
        assert ("usage" in r.json()) == (n % 3 == 0), n


def test_a_chunked_request_body_is_read_whole(server, engine, connect):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    c = connect()
    headers = {**auth(server), "Transfer-Encoding": "chunked"}
    c.send(request("POST", "/v1/chat/completions", headers=headers))
    c.send(chunked(body[:10], body[10:4000], body[4000:]))
    (r,) = c.read()
    assert r.status == 200, r.body
    assert engine.stats()["last_body"]["messages"][0]["content"] == "x" * 5000


def test_expect_100_continue_is_answered_only_when_the_body_is_wanted(server, connect):
    body = json.dumps(CHAT).encode()
    c = connect()
    c.send(request("POST", "/v1/chat/completions", headers={
        **auth(server), "Content-Length": str(len(body)), "Expect": "100-continue"}))  # fmt: skip
    assert c.read_raw().startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    c.send(body)
    (r,) = c.read()
    assert r.status == 200

    # A request refused before its body is read: no 100, the refusal, and the
    # connection closes (the body it might still send would be taken for a request).
    c = connect()
    c.send(request("POST", "/v1/chat/completions", headers={
        "Content-Length": str(len(body)), "Expect": "100-continue"}))  # fmt: skip
    (r,) = c.read()
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.wait_closed()


@pytest.mark.parametrize(
    "raw, status, code",
    [
        (request("GET", "/v1/models?" + "a" * 2000), 414, "url_too_long"),
        (request("GET", "/health", headers={"X-Big": "b" * 5000}), 431, "headers_too_large"),
        (
            request("GET", "/health", headers={f"X-{i}": "v" * 40 for i in range(200)}),
            431,
            "headers_too_large",
        ),  # fmt: skip
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400, "bad_request"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400, "bad_request"),  # TLS hello
    ],
    ids=["request-line", "header", "header-count", "malformed", "tls-on-plain"],
)
def test_requests_over_a_limit_or_malformed_are_refused_and_the_connection_closed(
    server, connect, raw, status, code
):
    c = connect()
    c.send(raw)
    (r,) = c.read()
    assert r.status == status
    assert r.json()["error"]["code"] == code
    assert r.headers["connection"] == "close"
    assert c.wait_closed()


def test_a_body_over_the_limit_is_refused_whether_announced_or_chunked(server, connect):
    c = connect()
    c.send(request("POST", "/v1/chat/completions", headers={
        **auth(server), "Content-Length": str(MAX_BODY + 1)}))  # fmt: skip
    (r,) = c.read()
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"
    assert c.wait_closed()

    c = connect()
    c.send(request("POST", "/v1/chat/completions", headers={
        **auth(server), "Transfer-Encoding": "chunked"}))  # fmt: skip
    c.send(chunked(b"{" + b" " * (MAX_BODY // 2), b" " * (MAX_BODY // 2) + b"}"))
    (r,) = c.read()
    assert r.status == 413
    assert c.wait_closed()


def test_a_client_that_sends_its_head_or_body_too_slowly_is_timed_out(server, connect):
    c = connect()
    c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    (r,) = c.read(timeout=10)
    assert r.status == 408 and r.json()["error"]["code"] == "request_timeout"
    assert c.wait_closed()

    c = connect()
    c.send(request("POST", "/v1/chat/completions", headers={**auth(server),
           "Content-Length": "100"}) + b'{"model": ')  # fmt: skip
    (r,) = c.read(timeout=10)
    assert r.status == 408
    assert c.wait_closed()


def test_head_is_answered_with_the_head_alone(server, connect):
    c = connect()
    c.send(request("HEAD", "/health") + request("GET", "/health"))
    raw = b""
    while raw.count(b"HTTP/1.1 200") < 2 or not raw.endswith(b"}"):
        raw += c.read_raw()
    head, rest = raw.split(b"\r\n\r\n", 1)
    length = int(next(v for k, v in (h.split(b": ", 1) for h in head.split(b"\r\n")[1:])
                      if k.lower() == b"content-length"))  # fmt: skip
    assert length > 0 and rest.startswith(b"HTTP/1.1 200 OK\r\n"), "no body after HEAD's"
    assert len(rest.split(b"\r\n\r\n", 1)[1]) == length, "GET's body is what HEAD announced"


def test_connection_close_and_http_1_0_are_honoured(server, connect):
    c = connect()
    c.send(request("GET", "/health", headers={"Connection": "close"}))
    (r,) = c.read()
    assert r.status == 200 and r.headers["connection"] == "close"
    assert c.wait_closed()

    c = connect()
    c.send(request("GET", "/health", version="1.0"))
    (r,) = c.read()
    assert r.status == 200 and r.version == "1.1" and not r.keep_alive
    assert c.wait_closed()

    # HTTP/1.0 with keep-alive asked for: kept, and a stream ends with the connection.
    c = connect()
    body = json.dumps({**CHAT, "stream": True}).encode()
    c.send(request("GET", "/health", headers={"Connection": "keep-alive"}, version="1.0"))
    (r,) = c.read()
    assert r.status == 200 and r.headers["connection"] == "keep-alive"
    c.send(request("POST", "/v1/chat/completions", body, auth(server), version="1.0"))
    assert c.wait_closed()
    (s,) = c.read()
    assert s.status == 200 and "transfer-encoding" not in s.headers
    assert s.body.rstrip().endswith(b"data: [DONE]")


def test_a_client_that_stops_reading_holds_back_the_engine_not_the_routers_memory(
    server, engine, connect
):
    """Backpressure: the router reads the engine no faster than the client reads it."""
    engine.control(chunks=200_000, delay_s=0)
    pid = server.proc.p.pid
    rss = rss_kib(pid)
    c = connect()
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.send(chat(server, stream=True, max_tokens=200_000))

    # The engine is stalled once every buffer on the way is full; wait for that.
    def stalled():
        before = engine.stats()["streamed_chunks"]
        eventually(lambda: engine.stats()["streamed_chunks"] > 0, what="the stream to begin")
        return 0 < before == engine.stats()["streamed_chunks"] < 200_000

    eventually(stalled, timeout=30, interval=0.5, what="the engine to be held back")
    assert rss_kib(pid) - rss < 32 * 1024
    c.close()  # and the client leaves: the engine's request is cancelled
    eventually(lambda: engine.stats()["cancelled"] >= 1, what="the engine request cancelled")


def test_a_stream_held_back_by_a_slow_client_resumes_with_every_event_in_order(
    server, engine, connect
):
    """A stream's pieces go to the client from the engine connection's callback until
    the client is slow to read; then the engine is held back, and once the client reads
    again the rest follows. Nothing is lost, doubled or reordered on the way."""
    n = 200_000  # about 20 MB: more than every buffer on the way holds
    engine.control(chunks=n, delay_s=0)
    c = connect(timeout=60)
    # The client's receive buffer left as it is: a small one would hold its TCP window
    # small too, and the rest of the stream would trickle in at a few KiB a round trip.
    c.send(chat(server, stream=True, max_tokens=n))

    def held_back():
        before = engine.stats()["streamed_chunks"]
        eventually(lambda: engine.stats()["streamed_chunks"] > 0, what="the stream to begin")
        return 0 < before == engine.stats()["streamed_chunks"] < n

    eventually(held_back, timeout=30, interval=0.5, what="the engine to be held back")
    (reply,) = c.read(1)
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    words = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert words == [WORDS[i % len(WORDS)] for i in range(n)]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- fuzzing ---------------------------------------------------------------------------

_PIECES = st.sampled_from([
    b"GET ", b"POST ", b"HEAD ", b"DELETE ", b"PUT ", b"BREW ", b"/", b"/v1/chat/completions",
    b"/health", b"/v1/models", b"?a=b", b"%00", b" HTTP/1.1", b" HTTP/1.0", b" HTTP/2.0",
    b" HTTP/1.1\r\n", b"\r\n", b"\n", b"\r", b"\r\n\r\n", b"Host: x\r\n",
    b"Content-Length: 5\r\n", b"Content-Length: -1\r\n", b"Content-Length: 99999999999\r\n",
    b"Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\n", b"0\r\n\r\n", b"zz\r\n",
    b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"Connection: upgrade\r\n",
    b"Upgrade: websocket\r\n", b": \r\n", b"X: \x00\xff\r\n", b'{"model":"m"}', b"\x00",
    b"\xff\xfe", b" ", b"\t",
])  # fmt: skip


@settings(max_examples=int(os.environ.get("LLMGW_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(pieces=st.lists(st.one_of(_PIECES, st.binary(max_size=40)), max_size=12))
def test_any_bytes_get_a_well_formed_answer_or_a_closed_connection(server, pieces):
    data = b"".join(pieces)
    c = Conn(server.url, timeout=5)
    try:
        c.send(data)
        c.sock.shutdown(socket.SHUT_WR)  # nothing more: whatever was sent is all
        # httptools raises on anything that is not well-formed HTTP/1.1 answers.
        assert c.wait_closed(timeout=5), f"no answer and no close for {data!r}"
        for reply in c.replies:
            assert 100 <= reply.status < 600
            if reply.status >= 400 and reply.body:
                assert "error" in reply.json()
    except (ConnectionResetError, BrokenPipeError):
        pass  # a connection cut is an answer too
    finally:
        c.close()
    # And the router goes on serving.
    c = Conn(server.url)
    c.send(request("GET", "/health"))
    (r,) = c.read()
    assert r.status == 200
    c.close()


def test_the_aiohttp_transport_still_serves_the_same_api(make_router, engine):
    """router.transport = "aiohttp", the fallback: the same handlers, the same answers."""
    import openai

    router = make_router([engine.url], transport="aiohttp")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=router.secret, max_retries=0)
    got = client.chat.completions.create(**CHAT)
    assert got.model == "m" and got.choices[0].message.content
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        **CHAT, stream=True) if c.choices]  # fmt: skip
    assert "".join(p or "" for p in pieces)
    r = router.post("/v1/chat/completions", CHAT, key="sk-wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "aiohttp" in r.headers.get("Server", "")  # it is aiohttp answering
    client.close()


_BODIES = st.one_of(
    st.just(json.dumps(CHAT).encode()),
    st.builds(lambda n: json.dumps({**CHAT, "max_tokens": n}).encode(), st.integers(-5, 50)),
    st.binary(max_size=60),
    st.just(b'{"model": "m"}'),
    st.just(b"[]"),
)
_ONE = st.one_of(
    st.tuples(st.just("GET"), st.sampled_from(["/health", "/v1/models", "/nope", "/v1/models/m"]),
              st.just(b"")),
    st.tuples(st.just("POST"), st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
              _BODIES),
)  # fmt: skip


@settings(max_examples=int(os.environ.get("LLMGW_FUZZ_EXAMPLES", "300")) // 3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(batch=st.lists(_ONE, min_size=1, max_size=4), chunked_bodies=st.booleans())
def test_pipelined_requests_of_any_shape_each_get_one_answer_in_order(
    server, batch, chunked_bodies
):
    c = Conn(server.url, timeout=10)
    try:
        data = b""
        for method, path, body in batch:
            headers = auth(server)
            if body and chunked_bodies:
                headers["Transfer-Encoding"] = "chunked"
                data += request(method, path, headers=headers) + chunked(body[:7], body[7:])
            else:
                data += request(method, path, body, headers)
        c.send(data)
        replies = c.read(len(batch))
        for (_, path, _), reply in zip(batch, replies, strict=True):
            assert 200 <= reply.status < 600
            if path == "/health":
                assert reply.json()["status"] == "ok"
            elif reply.status >= 400:
                assert "error" in reply.json(), reply.body
    finally:
        c.close()
