"""A real router whose collector is down: requests flow as ever, and what the traces lost
is counted on /metrics."""

import re

import requests

from tests.helpers import eventually, start_router
from tests.integration.conftest import ENGINE_KEY, dead_url

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def series(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}{{{want}}} (\S+)$" if want else rf"^{name} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_with_the_collector_down_requests_are_answered_and_the_lost_spans_counted(
    tmp_path, engine, api_key
):
    key_file = tmp_path / "engine.key"
    key_file.write_text(ENGINE_KEY + "\n")
    dead = dead_url()  # nothing listens: every export fails
    config = (
        '[router]\nlisten = "127.0.0.1:{port}"\nkey_refresh_s = 0.2\n'
        f'[[router.endpoints]]\nid = "e0"\nurl = "{engine.url}"\nmodels = ["m"]\n'
        f'key = "@{key_file}"\n'
        f'[tracing]\nendpoint = "{dead}"\nsample_rate = 1.0\nqueue_size = 8\n'
    )
    proc, url = start_router(tmp_path, config)
    try:
        headers = {"Authorization": f"Bearer {api_key[1]}"}
        eventually(
            lambda: requests.get(url + "/v1/models", headers=headers, timeout=5).status_code == 200,
            what="the router to accept the key",
        )
        for i in range(40):
            body = {**CHAT, "stream": i % 2 == 0}
            r = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
            assert r.status_code == 200, r.text
            assert (b"[DONE]" in r.content) if body["stream"] else r.json()["choices"]

        def lost():
            text = requests.get(url + "/metrics", timeout=5).text
            full = series(text, "llmgw_tracing_spans_dropped_total", reason="queue_full")
            failed = series(text, "llmgw_tracing_spans_dropped_total", reason="export_failed")
            batches = series(text, "llmgw_tracing_export_failures_total")
            return (full > 0 and failed > 0 and batches > 0) and (full, failed, batches)

        # 40 requests make about 150 spans; the queue holds 8, and the exporter is stuck
        # retrying a collector that is not there.
        full, failed, batches = eventually(lost, timeout=20, what="the lost spans counted")
        assert full + failed <= 40 * 4
        assert "tracing_export_failed" in proc.log()
        assert proc.log().count("tracing_export_failed") == 1, "logged once, not per batch"
    finally:
        assert proc.stop() == 0  # it stops in order, without waiting on the collector
