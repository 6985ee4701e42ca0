"""Prefix-aware routing through a real router and two fake engines that report what
they reused from their prompt caches."""

import os
import re
import threading

import pytest

from tests.helpers import eventually, free_port, llmgw, start_fake_engine, start_router
from tests.integration.conftest import ENGINE_KEY, Engine, Router

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


def test_a_shared_prompt_still_being_evaluated_is_waited_for(make_router, engines):
    """Two requests with one new system prompt, the second sent while the engine is
    still on the first's prompt: the router holds the second until the first ends, so
    the engine never evaluates that prompt twice side by side."""
    engines[0].control(cache="on", first_delay_s=3.0)  # "evaluating the prompt" 3 s
    router = make_router([engines[0].url], routing="prefix")
    results = {}

    def ask(name, question):
        messages = [{"role": "system", "content": SYSTEMS[2]},
                    {"role": "user", "content": question}]  # fmt: skip
        body = {"model": "m", "messages": messages, "max_tokens": 8, "stream": True}
        results[name] = router.post("/v1/chat/completions", body)

    first = threading.Thread(target=ask, args=("first", "What is a fox?"))
    first.start()
    eventually(lambda: engines[0].stats()["requests"] == 1, what="the first at the engine")
    second = threading.Thread(target=ask, args=("second", "What is a dog?"))
    second.start()
    first.join(30)
    second.join(30)
    assert results["first"].status_code == 200 and results["second"].status_code == 200
    assert "[DONE]" in results["second"].text
    stats = engines[0].stats()
    assert stats["requests"] == 2
    assert stats["peak_active"] == 1, "the engine had both prompts at once"
    text = router.metrics()
    assert metric(text, "llmgw_router_prefix_holds_total") == 1
    assert metric(text, "llmgw_router_prefix_hold_seconds_total") > 0


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


def test_routers_that_share_send_a_turn_where_the_other_sent_the_last(tmp_path, api_key, engines):
    """Router a serves only e1, router b both e0 and e1, and b's own choice for a prompt
    it never saw is e0 (the control router, b's table without peers, shows it). With
    `prefix_peers`, b sends the next turn of a conversation a sent to e1 there too."""
    conf = tmp_path / "conf"
    cli = tmp_path / "cli.toml"
    cli.write_text(f'[paths]\nconfig_dir = "{conf}"\n')
    for name in ("ra", "rb"):
        llmgw("routers", "add", name, "--store", env={"LLMGW_CONFIG": str(cli)})
    (tmp_path / "engine.key").write_text(ENGINE_KEY + "\n")
    shares = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("ra", "rb")}

    def start(name, served, peer=None):
        lines = ["[router]", 'listen = "127.0.0.1:{port}"', 'routing = "prefix"',
                 "key_refresh_s = 0.2"]  # fmt: skip
        if peer:
            lines += [f'bus_name = "{name}"', f'prefix_share = "{shares[name]}"',
                      f'prefix_peers = ["{peer}@{shares[peer]}"]']  # fmt: skip
        for i in served:
            lines += ["[[router.endpoints]]", f'id = "e{i}"', f'url = "{engines[i].url}"',
                      'models = ["m"]', f'key = "@{tmp_path / "engine.key"}"']  # fmt: skip
        lines += ["[paths]", f'config_dir = "{conf}"', f'state_dir = "{tmp_path / name}"']
        proc, url = start_router(tmp_path, "\n".join(lines) + "\n")
        router = Router(proc, url, api_key[1], os.environ["LLMGW_STORE"])
        eventually(lambda: router.get("/v1/models").status_code == 200, what=f"{name} up")
        return router

    def served_by(router, body):
        before = counts(engines)
        r = router.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        after = counts(engines)
        return next(j for j in range(2) if after[j] > before[j])

    def heard(router):
        m = re.search(r'^llmgw_router_prefix_shared_messages_total\{what="heard"\} (\S+)$',
                      router.metrics(), re.M)  # fmt: skip
        return float(m.group(1)) if m else 0.0

    # A system prompt whose rendezvous home among e0 and e1 is e0.
    system = next(s for s in (f"Rules of team {i}. " * 30 for i in range(50))
                  if home_of(s, ["e0", "e1"]) == "e0")  # fmt: skip
    first, second = list(turns(system, 2))
    started = []
    try:
        a = start("ra", [1], peer="rb")
        b = start("rb", [0, 1], peer="ra")
        control = start("rc", [0, 1])
        started = [a, b, control]
        eventually(lambda: heard(b) > 0, timeout=15, what="b to hear a's heartbeat")
        before = heard(b)
        assert served_by(a, first) == 1
        eventually(lambda: heard(b) >= before + 2, what="b to hear a's choice and its end")
        assert served_by(control, second) == 0  # alone, b's table would send it to e0
        assert served_by(b, second) == 1
    finally:
        for r in started:
            r.proc.stop()


def home_of(system: str, ids: list[str]) -> str:
    """The replica prefix routing picks for a prompt nobody holds (rendezvous hashing)."""
    import zlib

    from llmgw_router.prefix import request_key

    key = request_key(next(turns(system, 1)))
    return max(ids, key=lambda i: zlib.crc32(i.encode(), key.anchor))


@pytest.mark.parametrize(
    "settings, said",
    [
        (
            'routing = "least-outstanding"\nprefix_peers = ["rb@tcp://127.0.0.1:1"]',
            'router.prefix_share and router.prefix_peers need router.routing = "prefix"',
        ),
        (
            'routing = "prefix"\nprefix_peers = ["tcp://127.0.0.1:1"]',
            "router.prefix_peers: 'tcp://127.0.0.1:1': want NAME@ENDPOINT",
        ),
        (
            'routing = "prefix"\nprefix_peers = ["nobody@tcp://127.0.0.1:1"]',
            "router.prefix_peers: nobody is not a registered router (`llmgw routers add nobody`)",
        ),
        (
            'routing = "prefix"\nbus_name = "ghost"\nprefix_share = "tcp://127.0.0.1:1"',
            "router.prefix_share: ",
        ),
    ],
    ids=["not-prefix", "no-name", "unregistered", "no-keypair"],
)
def test_sharing_misconfigured_stops_the_router_with_one_line(tmp_path, settings, said):
    import subprocess

    from tests.helpers import BIN

    cfg = tmp_path / "router.toml"
    endpoint = '[[router.endpoints]]\nid = "e0"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\n'
    paths = f'[paths]\nconfig_dir = "{tmp_path / "conf"}"\nstate_dir = "{tmp_path}"\n'
    cfg.write_text(f'[router]\nlisten = "127.0.0.1:{free_port()}"\n{settings}\n{endpoint}{paths}')
    result = subprocess.run([str(BIN / "llmgw-router"), "--config", str(cfg)],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("Error: " + said), lines
