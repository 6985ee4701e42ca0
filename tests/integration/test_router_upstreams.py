"""Failing engines: retries, cooldowns, errors mid-stream, and clients that leave."""

import json
import re
import socketserver
import threading
import time

import openai
import pytest

from tests.helpers import eventually
from tests.integration.conftest import dead_url

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def usage_rows(router):
    from llmgw.store import Usage, open_store

    db = open_store(router.store_url)
    try:
        return list(Usage.select().order_by(Usage.at))
    finally:
        db.close()


class RawEngine:
    """An engine that answers every request with the same bytes, then closes: for answers
    no real engine gives."""

    def __init__(self, reply: bytes):
        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = self.rfile.readline()
                    if not line:
                        return
                    head += line
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                if length:
                    self.rfile.read(int(length.group(1)))
                self.wfile.write(reply)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def raw_engine():
    engines = []

    def make(reply: bytes) -> RawEngine:
        engines.append(RawEngine(reply))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def test_an_engine_that_breaks_http_framing_gets_the_client_a_clean_502(make_router, raw_engine):
    bad = raw_engine(
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4\r\n{}{}\r\n0\r\n\r\n"
    )
    router = make_router([bad.url])
    resp = router.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "upstream_unavailable" and "malformed" in error["message"]
    assert 'llmgw_router_upstream_errors_total{endpoint="e0",kind="protocol"} 1.0' in (
        router.metrics()
    )
    assert "Traceback" not in router.proc.log()


def test_a_stream_whose_engine_breaks_http_mid_way_ends_with_an_error_event(
    make_router, raw_engine
):
    event = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    bad = raw_engine(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (len(event), event)
        + b"not-a-size\r\n"
    )
    router = make_router([bad.url])
    with router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert b'"hi"' in events[0]
    assert "malformed" in json.loads(events[-1][6:])["error"]["message"]
    rows = eventually(lambda: usage_rows(router), what="a usage row")
    assert rows[-1].status == 502
    assert "Traceback" not in router.proc.log()


def test_a_refused_connection_is_retried_on_another_endpoint(make_router, engine):
    router = make_router([dead_url(), engine.url])
    for _ in range(4):
        resp = router.post("/v1/chat/completions", CHAT)
        assert resp.status_code == 200
    assert (
        'llmgw_router_upstream_errors_total{endpoint="e0",kind="connect"} 1.0' in router.metrics()
    ), "the dead endpoint is tried once, then cooled down"


def test_an_engine_that_is_still_loading_is_skipped_for_another(make_router, engine, tmp_path):
    from tests.helpers import start_fake_engine
    from tests.integration.conftest import ENGINE_KEY

    busy_proc, busy_url = start_fake_engine(tmp_path, key=ENGINE_KEY, name="busy")
    try:
        import requests

        requests.post(busy_url + "/_control", json={"mode": "busy"}, timeout=5)
        router = make_router([busy_url, engine.url])
        assert all(router.post("/v1/chat/completions", CHAT).status_code == 200 for _ in range(3))
    finally:
        busy_proc.stop()


def test_when_every_endpoint_fails_the_client_hears_why_then_when_to_come_back(make_router):
    router = make_router([dead_url()])
    first = router.post("/v1/chat/completions", CHAT)
    assert first.status_code == 502
    assert first.json()["error"]["code"] == "upstream_unavailable"
    assert "endpoint e0" in first.json()["error"]["message"]
    second = router.post("/v1/chat/completions", CHAT)
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "no_healthy_endpoint"
    assert int(second.headers["Retry-After"]) >= 1


def test_an_engine_error_reaches_the_client_in_openai_shape(router, engine):
    engine.control(mode="fail")
    resp = router.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "fake engine told to fail"


def test_an_engine_that_drops_mid_stream_ends_the_stream_with_an_error_event(router, engine):
    engine.control(mode="drop", drop_after=2, chunks=5)
    with router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert len(events) == 3
    assert "error" in json.loads(events[-1][6:])
    rows = eventually(lambda: usage_rows(router), what="a usage row")
    assert rows[-1].status == 502 and rows[-1].completion_tokens == 2


def test_a_stream_whose_engine_dies_before_the_first_token_is_answered_by_another(
    make_router, engine, tmp_path
):
    from tests.helpers import start_fake_engine
    from tests.integration.conftest import ENGINE_KEY

    # As an engine killed while it reads a long prompt: the stream's headers went out,
    # no token did (seen in the chaos suite: answered 502, though nobody had anything).
    drop_proc, drop_url = start_fake_engine(tmp_path, key=ENGINE_KEY, name="drop")
    try:
        import requests

        requests.post(drop_url + "/_control", json={"mode": "drop", "drop_after": 0}, timeout=5)
        router = make_router([drop_url, engine.url])

        # Until the router has tried the dropping engine (it picks by load), every
        # stream must end complete, with no error event.
        deadline = time.monotonic() + 10
        while requests.get(drop_url + "/_stats", timeout=5).json()["requests"] == 0:
            assert time.monotonic() < deadline, "the router never tried the dropping engine"
            with router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True) as r:
                assert r.status_code == 200
                events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
            assert events[-1] == b"data: [DONE]", events
            assert not any(b'"error"' in e for e in events), events
        assert "stream_interrupted" in router.metrics()
    finally:
        drop_proc.stop()


def test_a_client_that_disconnects_frees_the_engine_and_still_gets_a_usage_row(router, engine):
    engine.control(mode="hold", drop_after=1, chunks=3)
    resp = router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True)
    next(line for line in resp.iter_lines() if line)
    resp.close()
    eventually(lambda: engine.stats()["cancelled"] == 1, what="the engine request cancelled")
    row = eventually(lambda: usage_rows(router), what="a usage row")[-1]
    assert row.status == 499
    assert row.completion_tokens == 1
    assert engine.stats()["active"] == 0


def test_a_non_streaming_client_that_leaves_cancels_the_engine_request(router, engine):
    engine.control(mode="stall")
    client = openai.OpenAI(
        base_url=router.url + "/v1", api_key=router.secret, max_retries=0, timeout=0.5
    )
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=CHAT["messages"])
    eventually(lambda: engine.stats()["cancelled"] == 1, what="the engine request cancelled")


def test_a_client_that_leaves_mid_stream_is_one_log_line_and_no_traceback(router, engine):
    """The router was writing when the client went: the failed write used to escape to
    aiohttp, which logged "Error handling request" and a traceback after the event."""
    import socket
    import struct

    engine.control(chunks=100000)
    host, port = router.url.removeprefix("http://").split(":")
    body = json.dumps({**CHAT, "stream": True}).encode()
    leaving = 20
    for _ in range(leaving):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            # Leave with a reset, mid-write: no FIN the router could notice first.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                + f"\r\nAuthorization: Bearer {router.secret}\r\nContent-Length: {len(body)}"
                .encode() + b"\r\n\r\n" + body
            )  # fmt: skip
            got = b""
            while got.count(b"data: ") < 3:
                got += s.recv(65536)
    eventually(lambda: router.proc.log().count("client_disconnected") >= leaving,
               what="every disconnect logged")  # fmt: skip
    eventually(lambda: engine.stats()["active"] == 0, what="the engine's streams to end")
    log = router.proc.log()
    assert log.count("client_disconnected") == leaving
    assert "Traceback" not in log and "Error handling request" not in log
