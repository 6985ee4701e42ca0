"""Prefix-aware routing through a real router and two fake engines that report what
they reused from their prompt caches."""

import re

import pytest

from tests.helpers import start_fake_engine
from tests.integration.conftest import ENGINE_KEY, Engine

SYSTEMS = [f"You are assistant number {i}. Answer briefly and kindly. " * 30 for i in range(3)]


@pytest.fixture
def engines(tmp_path):
    started = [start_fake_engine(tmp_path, key=ENGINE_KEY, name=f"e{i}") for i in range(2)]
    yield [Engine(proc, url) for proc, url in started]
    for proc, _ in started:
        proc.stop()


def turns(system, n):
    """The request of each turn of one conversation, replies appended."""
    messages = [{"role": "system", "content": system}]
    for t in range(n):
        messages = [*messages, {"role": "user", "content": f"question {t} about the subject"}]
        yield {"model": "m", "messages": messages, "max_tokens": 8}
        messages = [*messages, {"role": "assistant", "content": "The quick brown fox."}]


def counts(engines):
    return [e.stats()["requests"] for e in engines]


def metric(text, name):
    m = re.search(rf'^{name}\{{model="m"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_conversations_turns_go_to_the_replica_holding_its_prefix(make_router, engines):
    for e in engines:
        e.control(cache="on")
    router = make_router([e.url for e in engines], routing="prefix")
    for system in SYSTEMS:
        where = set()
        for body in turns(system, 4):
            before = counts(engines)
            r = router.post("/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            after = counts(engines)
            where.add(next(j for j in range(2) if after[j] > before[j]))
        assert len(where) == 1, f"one conversation's turns went to engines {where}"
    text = router.metrics()
    assert metric(text, "llmgw_router_prefix_cached_tokens_total") > 0
    assert metric(text, "llmgw_router_prefix_hit_ratio") > 0.5
    assert metric(text, "llmgw_router_prefix_chain_drops_total") == 0


def test_a_replica_whose_engine_caches_nothing_loses_the_chain(make_router, engines):
    for e in engines:
        e.control(cache="off")
    router = make_router([e.url for e in engines], routing="prefix")
    for body in turns(SYSTEMS[0], 3):
        assert router.post("/v1/chat/completions", body).status_code == 200
    text = router.metrics()
    assert metric(text, "llmgw_router_prefix_predicted_cached_tokens_total") > 100
    assert metric(text, "llmgw_router_prefix_cached_tokens_total") == 0
    assert metric(text, "llmgw_router_prefix_chain_drops_total") >= 1
    assert metric(text, "llmgw_router_prefix_hit_ratio") == 0


def test_streamed_answers_report_what_the_engine_cached_too(make_router, engines):
    for e in engines:
        e.control(cache="on")
    router = make_router([e.url for e in engines], routing="prefix")
    for body in turns(SYSTEMS[1], 3):
        r = router.post("/v1/chat/completions", {**body, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text
    assert metric(router.metrics(), "llmgw_router_prefix_cached_tokens_total") > 100
