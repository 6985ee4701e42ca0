"""Traces through the whole llmgw: the real scheduler, agent and router with the fake
engine, exporting to a real OTLP/gRPC receiver (tests/otlp_receiver.py)."""

import json
import os

import pytest
import requests

from llmgw.store import Usage, open_store
from tests.helpers import eventually
from tests.otlp_receiver import Receiver
from tests.system.conftest import GiB

TRACE = "5b8efff798038103d269b633813fc60c"
CALLER = "eee19b7ec3c1b174"
ADMIN_TRACE = "a3ce929d0e0e47364bf92f3577b34da6"


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


def usage_row(rid: str):
    db = open_store(os.environ["LLMGW_STORE"])
    try:
        return Usage.get_or_none(Usage.request_id == rid)
    finally:
        db.close()


def test_a_streamed_chat_is_one_trace_from_its_caller_through_the_router_to_the_engine(
    cluster, api_key, receiver
):
    c = cluster
    # The router samples 10% by itself; this request is traced because its caller's is.
    c.router_extra = f'[tracing]\nendpoint = "{receiver.endpoint}"\nsample_rate = 0.1\n'
    c.scheduler_extra = f'[tracing]\nendpoint = "{receiver.endpoint}"\nsample_rate = 1.0\n'
    c.add_model("m", memory=GiB)
    c.start_scheduler()
    c.start_agent("node-a", memory=2 * GiB)
    c.start_router(api_key[1])
    eventually(lambda: c.serves("m"), timeout=30, what="model m to be served")

    r = requests.post(
        f"{c.router_url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={
            "Authorization": f"Bearer {c.secret}",
            "traceparent": f"00-{TRACE}-{CALLER}-01",
        },
        stream=True,
        timeout=10,
    )
    assert r.status_code == 200
    body = b"".join(r.iter_content(None))
    assert body.rstrip().endswith(b"data: [DONE]")
    rid = r.headers["x-request-id"]

    def complete(rec):
        names = sorted(s.name for s in rec.trace(TRACE))
        return names == ["chat m", "llmgw.attempt", "llmgw.stream"] and names

    receiver.wait(complete, what="the request's three spans")
    spans = {s.name: s for s in receiver.trace(TRACE)}
    req, attempt, stream = spans["chat m"], spans["llmgw.attempt"], spans["llmgw.stream"]

    # The structure: the caller's span, the request's, and its children.
    assert (req.parent_id, req.kind, req.service) == (CALLER, "SERVER", "llmgw-router")
    assert (attempt.parent_id, attempt.kind) == (req.span_id, "CLIENT")
    assert stream.parent_id == attempt.span_id
    assert req.start_ns <= attempt.start_ns <= stream.start_ns
    assert stream.end_ns <= attempt.end_ns <= req.end_ns

    # The GenAI conventions' attributes, with the usage row's own numbers.
    row = eventually(lambda: usage_row(rid), what="the request's usage row")
    a = req.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "m"
    assert a["gen_ai.usage.input_tokens"] == row.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == row.completion_tokens > 0
    assert a["gen_ai.response.time_to_first_chunk"] * 1000 == pytest.approx(row.ttft_ms)
    assert a["http.response.status_code"] == row.status == 200
    assert a["llmgw.request_id"] == rid
    assert a["gen_ai.provider.name"] == "fake"  # the engine that answered

    # The engine attempt: where it went, and that the engine heard which attempt it was.
    (replica,) = [x for x in c.admin("/v1/replicas") if x["model"] == "m"]
    assert attempt.attributes["llmgw.replica.id"] == replica["id"] == row.endpoint
    assert replica["endpoint"].endswith(f":{attempt.attributes['server.port']}")
    assert attempt.attributes["http.response.status_code"] == 200
    heard = requests.get(replica["endpoint"] + "/_stats", timeout=5).json()["last_headers"]
    version, trace_id, parent, flags = heard["traceparent"].split("-")
    assert (version, trace_id, parent) == ("00", TRACE, attempt.span_id)
    assert int(flags, 16) & 1, "the engine was told the trace is sampled"
    assert stream.attributes["llmgw.stream.ended"] is True

    # The scheduler: its admin requests, and the pass that started the replica.
    token = (c.etc / "secrets" / "admin.token").read_text().strip()
    got = requests.get(
        f"http://127.0.0.1:{c.admin_port}/v1/replicas",
        headers={
            "Authorization": f"Bearer {token}",
            "traceparent": f"00-{ADMIN_TRACE}-{CALLER}-01",
        },
        timeout=5,
    )
    assert got.status_code == 200
    (admin,) = receiver.wait(lambda rec: rec.trace(ADMIN_TRACE), what="the admin request's span")
    assert (admin.name, admin.parent_id, admin.service) == (
        "GET /v1/replicas",
        CALLER,
        "llmgw-scheduler",
    )
    assert admin.attributes["http.response.status_code"] == 200
    placed = [
        s
        for s in receiver.named("llmgw.placement_pass")
        if "m@node-a" in s.attributes["llmgw.starts"]
    ]
    assert placed and placed[0].service == "llmgw-scheduler", json.dumps(
        [s.attributes for s in receiver.named("llmgw.placement_pass")]
    )
