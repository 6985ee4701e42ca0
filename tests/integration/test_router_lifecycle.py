"""Keys appearing and going, usage rows, metrics, and an orderly SIGTERM."""

import json
import signal
import subprocess

from tests.helpers import BIN, eventually, llmgw
from tests.integration.test_router_upstreams import usage_rows

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_new_key_works_and_a_revoked_one_stops_after_the_next_refresh(make_router, engine):
    router = make_router([engine.url], key_refresh_s=2.0)  # the default
    new = json.loads(llmgw("keys", "create", "--store", "--name", "late", "--json").stdout)
    eventually(
        lambda: router.post("/v1/chat/completions", CHAT, key=new["secret"]).status_code == 200,
        timeout=20,  # a deadline, not a timing: the refresh runs every 2 s
        what="the new key to be accepted",
    )
    llmgw("keys", "revoke", "--store", new["id"])
    eventually(
        lambda: router.post("/v1/chat/completions", CHAT, key=new["secret"]).status_code == 401,
        timeout=20,
        what="the revoked key to be refused",
    )


def test_an_expired_key_is_refused(make_router, engine):
    router = make_router([engine.url])
    key = json.loads(
        llmgw("keys", "create", "--store", "--name", "brief", "--expires", "1s", "--json").stdout
    )
    eventually(
        lambda: (
            router.post("/v1/chat/completions", CHAT, key=key["secret"]).status_code == 401
            and key_is_known(key["id"])
        ),
        timeout=10,
        what="the key to expire",
    )


def key_is_known(key_id):
    keys = json.loads(llmgw("keys", "list", "--store", "--all", "--json").stdout)
    return any(k["id"] == key_id and k["state"] == "expired" for k in keys)


def test_every_request_gets_a_usage_row_with_its_tokens(router, api_key):
    ok = router.post("/v1/chat/completions", CHAT)
    router.post("/v1/chat/completions", {**CHAT, "stream": True})
    router.post("/v1/chat/completions", {**CHAT, "model": "nope"})
    rows = eventually(lambda: len(r := usage_rows(router)) == 3 and r, what="three usage rows")
    first = next(r for r in rows if r.request_id == ok.headers["x-request-id"])
    assert (first.key_id, first.model, first.endpoint, first.status) == (api_key[0], "m", "e0", 200)
    assert (first.prompt_tokens, first.completion_tokens) == (7, 5)
    streamed = rows[1]
    assert streamed.completion_tokens == 5 and streamed.ttft_ms is not None
    assert rows[2].status == 404 and rows[2].endpoint is None


def test_sigterm_lets_a_stream_finish_and_flushes_usage_before_exiting(make_router, engine):
    router = make_router([engine.url], usage_flush_s=3600.0)  # only the exit flush writes
    engine.control(mode="hold", drop_after=1, chunks=3)
    resp = router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True)
    lines = resp.iter_lines()
    next(line for line in lines if line)
    router.proc.p.send_signal(signal.SIGTERM)
    eventually(
        lambda: "Stopping" in router.proc.log() or router.proc.p.poll() is None,
        what="the router to take the signal",
    )
    engine.control(release=True)
    rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    assert router.proc.p.wait(timeout=30) == 0
    rows = usage_rows(router)
    assert [r.status for r in rows] == [200]


def test_metrics_count_requests_tokens_and_errors_without_naming_keys(router, api_key):
    router.post("/v1/chat/completions", CHAT)
    router.post("/v1/chat/completions", {**CHAT, "model": "nope"})
    text = router.metrics()
    assert 'llmgw_router_requests_total{model="m",status="200"} 1.0' in text
    assert 'llmgw_router_tokens_total{kind="completion",model="m"} 5.0' in text
    assert 'llmgw_router_requests_total{model="",status="404"} 1.0' in text
    assert "llmgw_router_overhead_seconds_count 1.0" in text
    assert "llmgw_router_in_flight_requests 0.0" in text
    assert api_key[0] not in text and "nope" not in text


def test_a_bad_config_stops_the_router_with_one_line_on_stderr(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[router]\nlisten = '127.0.0.1:1'\nlisen = 'x'\n")
    result = subprocess.run(
        [str(BIN / "llmgw-router"), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [f"Error: {cfg}: unknown key 'router.lisen'"]


def test_an_unreachable_store_stops_the_router_with_the_reason(tmp_path):
    result = subprocess.run(
        [str(BIN / "llmgw-router"), "--endpoint", "e=http://127.0.0.1:1=m"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"LLMGW_STORE": "postgresql://u:pw@127.0.0.1:1/x", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "cannot open store postgresql://u:***@127.0.0.1:1/x" in result.stderr
    assert "pw" not in result.stderr


def test_an_invalid_catalog_stops_router_and_scheduler_and_fails_config_check_alike(tmp_path):
    """Fail closed: a router that ran on with an empty catalog would count no budget at
    its prices and try no fallback, while the scheduler refuses the same file."""
    cfg = tmp_path / "etc" / "llmgw.toml"
    cfg.write_text(
        cfg.read_text()
        + '[router]\nlisten = "127.0.0.1:1"\n'
        + '[[models]]\nname = "gemma"\nsource = "/m.gguf"\n[models.profile]\ncontext = 10\n'
    )
    line = "Error: model 'gemma': profile.context must be at least 256"
    seen = {}
    for tool in ("llmgw-router", "llmgw-scheduler"):
        result = subprocess.run([str(BIN / tool), "--config", str(cfg)], capture_output=True,
                                text=True, timeout=30)  # fmt: skip
        seen[tool] = (result.returncode, result.stderr.strip().splitlines())
    check = llmgw("--config", str(cfg), "config", "check", check=False)
    seen["llmgw config check"] = (check.returncode, check.stderr.strip().splitlines())
    assert seen == {tool: (1, [line]) for tool in seen}
    assert check.stdout == ""
