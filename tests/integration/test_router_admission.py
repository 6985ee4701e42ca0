"""Admission by band on a saturated model, and fallbacks, through a real router."""

import json
import os
import threading
import time

import requests

from llmgw.store import Usage, open_store
from tests.helpers import eventually, start_fake_engine
from tests.integration.conftest import CHAT, Client, ctl

STREAM = {**CHAT, "stream": True}
# One slot a replica. The router believes an engine's own /slots once it has asked, so
# tests that saturate a model tell the fake engine it has one slot too, before starting.
ONE_SLOT = "slots_per_replica = 1\nengine_probe_s = 0.1\n"


def key(band: str) -> str:
    return ctl("keys", "create", "--name", band, "--band", band)["secret"]


def queued(client: Client) -> float:
    total = 0.0
    for line in client.metrics().splitlines():
        if line.startswith("llmgw_router_queue_depth{"):
            total += float(line.split()[-1])
    return total


def hold_the_only_slot(client: Client, engine, secret: str):
    """A stream that keeps the model's single slot until the engine is released."""
    return hold_the_only_slot_of(client, engine, secret, "m")


def hold_the_only_slot_of(client: Client, engine, secret: str, model: str):
    engine.control(mode="hold", drop_after=1, chunks=2)
    resp = client.chat({**STREAM, "model": model}, secret=secret, stream=True)
    lines = resp.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    return resp, lines


def test_a_freed_slot_goes_to_the_highest_band_waiting(limited_router, engine):
    secrets = {band: key(band) for band in ("gold", "silver", "bronze")}
    engine.control(n_slots=1)
    client = limited_router(secrets["gold"], extra=ONE_SLOT)
    holder, rest = hold_the_only_slot(client, engine, secrets["bronze"])
    done = []

    def ask(band):
        done.append((band, client.chat(secret=secrets[band]).status_code))

    threads = []
    for i, band in enumerate(("bronze", "silver", "gold")):  # the lowest band asks first
        threads.append(threading.Thread(target=ask, args=(band,)))
        threads[-1].start()
        eventually(lambda i=i: queued(client) == i + 1, what=f"{i + 1} queued")
    metrics = client.metrics()
    assert 'llmgw_router_queue_depth{band="bronze",model="m"} 1.0' in metrics
    engine.control(release=True)
    list(rest)
    holder.close()
    for t in threads:
        t.join()
    assert sorted(done) == [("bronze", 200), ("gold", 200), ("silver", 200)]
    # The router answered them one at a time, in the order it admitted them: its usage
    # rows (the clients' threads may be scheduled in any order on a busy machine).
    by_key = {ctl("keys", "list", "--all")[i]["id"]: band for i, band in
              enumerate(("gold", "silver", "bronze"))}  # fmt: skip
    order = eventually(lambda: answered_in_order(by_key, 4), what="four usage rows")
    assert order == ["bronze", "gold", "silver", "bronze"]  # the holder, then by band


def answered_in_order(bands_by_key: dict, n: int) -> list[str] | None:
    db = open_store(os.environ["LLMGW_STORE"])
    try:
        rows = list(Usage.select().order_by(Usage.id))
    finally:
        db.close()
    return [bands_by_key[r.key_id] for r in rows] if len(rows) >= n else None


def test_a_request_whose_queue_deadline_passes_gets_503_with_retry_after(limited_router, engine):
    secret = key("silver")
    engine.control(n_slots=1)
    client = limited_router(secret, extra=ONE_SLOT + "queue_deadline_s = 0.3\n")
    holder, rest = hold_the_only_slot(client, engine, secret)
    t0 = time.monotonic()
    resp = client.chat()
    assert time.monotonic() - t0 >= 0.3
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "model_saturated"
    assert int(resp.headers["Retry-After"]) >= 1
    assert 'llmgw_router_queue_rejections_total{band="silver"} 1.0' in client.metrics()
    engine.control(release=True)
    list(rest)
    holder.close()


def test_an_idle_model_is_admitted_without_queueing(limited_router, engine):
    secret = key("bronze")
    client = limited_router(secret, extra=ONE_SLOT)
    assert [client.chat().status_code for _ in range(3)] == [200, 200, 200]
    assert "llmgw_router_queue_wait_seconds_count" not in client.metrics()


# -- fallbacks ------------------------------------------------------------------------

CATALOG = """
[[models]]
name = "big"
source = "/models/big.gguf"
fallbacks = ["small"]
[models.pricing]
input_per_mtok = 10.0
output_per_mtok = 10.0
[[models]]
name = "small"
source = "/models/small.gguf"
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 1.0
"""


def test_a_model_nobody_serves_falls_back_and_usage_records_both(limited_router, engine):
    secret = key("silver")
    client = limited_router(secret, extra=CATALOG, models=("small",))
    resp = client.chat({**CHAT, "model": "big"})
    assert resp.status_code == 200
    assert resp.headers["x-llmgw-served-model"] == "small"
    # The engine was asked for the model that answers.
    assert engine.stats()["last_body"]["model"] == "small"
    assert "reason=\"unservable\"" in next(
        line for line in client.metrics().splitlines()
        if line.startswith("llmgw_router_fallbacks_total{")
    )  # fmt: skip
    rows = eventually(lambda: ctl("usage", "--by", "model"), what="the usage row")
    assert [(r["model"], r["requests"]) for r in rows] == [("small", 1)]
    assert rows[0]["cost"] == 12 / 1e6, "priced as the model that answered"


def test_a_model_whose_engine_fails_falls_back_before_the_first_byte(
    limited_router, engine, tmp_path
):
    broken, broken_url = start_fake_engine(tmp_path, key="engine-key-for-tests", name="broken")
    try:
        requests.post(broken_url + "/_control", json={"mode": "fail"}, timeout=5)
        secret = key("gold")
        client = limited_router(
            secret,
            extra=CATALOG,
            endpoints=[("e-big", broken_url, ("big",)), ("e-small", engine.url, ("small",))],
        )
        resp = client.chat({**CHAT, "model": "big"})
        assert resp.status_code == 200 and resp.headers["x-llmgw-served-model"] == "small"
        stream = client.chat({**STREAM, "model": "big"}, stream=True)
        assert stream.headers["x-llmgw-served-model"] == "small"
        assert stream.text.rstrip().endswith("data: [DONE]")
        # Without a fallback the engine's own error comes back, as before.
        alone = client.chat({**CHAT, "model": "small"})
        assert alone.status_code == 200
        requests.post(engine.url + "/_control", json={"mode": "fail"}, timeout=5)
        both = client.chat({**CHAT, "model": "big"})
        assert both.status_code == 500
        assert both.json()["error"]["message"]
    finally:
        broken.stop()
    assert "llmgw_router_fallbacks_total" in client.metrics()


def test_slots_busy_with_another_routers_requests_count_as_saturation(limited_router, engine):
    # No slots in the config: the engine's own /slots says 1, and that it is busy.
    engine.control(n_slots=1, extra_busy=1)
    secret = key("gold")
    client = limited_router(secret, extra="queue_deadline_s = 0.5\nengine_probe_s = 0.1\n")
    error = eventually(
        lambda: (r := client.chat()).status_code == 503 and r.json()["error"],
        what="the probe to see /slots",
    )
    assert error["code"] == "model_saturated"
    engine.control(extra_busy=0)  # the other router's request is done
    eventually(lambda: client.chat().status_code == 200, what="the slot to be seen free")


DEARER = """
[[models]]
name = "cheap"
source = "/models/cheap.gguf"
fallbacks = ["dear"]
[models.pricing]
input_per_mtok = 1.0
output_per_mtok = 1.0
[[models]]
name = "dear"
source = "/models/dear.gguf"
[models.pricing]
input_per_mtok = 1000.0
output_per_mtok = 1000.0
"""


def test_a_dearer_fallback_is_tried_only_if_the_cost_budget_covers_its_prices(
    limited_router, engine
):
    made = ctl("keys", "create", "--name", "k")
    body = {**CHAT, "model": "cheap"}
    cheap = len(json.dumps(body)) + body["max_tokens"]  # millionths at 1 per million
    ctl("budgets", "set", "--key", made["id"], "--period", "day", "--cost", str(100 * cheap / 1e6))
    client = limited_router(made["secret"], extra=DEARER, models=("dear",))
    resp = client.chat(body)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_not_ready"
    assert engine.stats()["requests"] == 0
    ctl("budgets", "set", "--key", made["id"], "--period", "day", "--cost", str(2000 * cheap / 1e6))
    resp = eventually(lambda: (r := client.chat(body)).status_code == 200 and r.headers,
                      what="the budget to cover the dearer model")  # fmt: skip
    assert resp["x-llmgw-served-model"] == "dear"


def test_a_model_saturated_past_the_deadline_falls_back(limited_router, engine, tmp_path):
    other, other_url = start_fake_engine(tmp_path, key="engine-key-for-tests", name="small")
    try:
        secret = key("silver")
        engine.control(n_slots=1)
        client = limited_router(
            secret,
            extra="queue_deadline_s = 0.3\nengine_probe_s = 0.1\n" + CATALOG,  # 1 slot each
            endpoints=[("e-big", engine.url, ("big",)), ("e-small", other_url, ("small",))],
        )
        holder, rest = hold_the_only_slot_of(client, engine, secret, "big")
        resp = client.chat({**CHAT, "model": "big"})
        assert resp.status_code == 200
        assert resp.headers["x-llmgw-served-model"] == "small"
        assert 'reason="saturated"' in client.metrics()
        engine.control(release=True)
        list(rest)
        holder.close()
    finally:
        other.stop()
