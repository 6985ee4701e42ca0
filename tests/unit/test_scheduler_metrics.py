"""The scheduler's fleet series are read from its state at scrape time: the real
scheduler and its admin API in process, a fake clock, a registry of the test's own."""

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from llmgw_scheduler import admin, metrics
from tests.fake_fleet import Fleet, model
from tests.helpers import free_port

TOKEN = "t" * 32


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("kept")])
    f.registry = CollectorRegistry()
    metrics.watch_fleet(f.sched, f.registry)
    f.heartbeat("a", kind="hello")
    yield f
    f.close()


def scrape(fleet) -> str:
    return generate_latest(fleet.registry).decode()


def series(text: str, model: str) -> list[str]:
    return [line for line in text.splitlines() if f'model="{model}"' in line]


def park(fleet, name: str) -> None:
    for _ in range(5):
        fleet.clock.advance(400)
        fleet.heartbeat("a")
        fleet.tick()
        for _node, body in fleet.sent("start_shard"):
            if body["model"] == name:
                fleet.shard("a", body["id"], "failed", "error loading model: bad magic")
            else:
                fleet.shard("a", body["id"], "ready")
    assert name in fleet.sched.parked


def test_a_removed_parked_model_s_series_are_gone_from_the_next_scrape(fleet):
    server = admin.serve(fleet.sched, f"127.0.0.1:{free_port()}", TOKEN)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        added = requests.post(f"{url}/v1/models", headers=auth, timeout=5, json={
            "name": "broken", "source": "/models/broken.gguf",
            "profile": {"memory_bytes": 1 << 30}})  # fmt: skip
        assert added.status_code == 201, added.text
        park(fleet, "broken")
        assert 'llmgw_model_parked{model="broken"} 1.0' in scrape(fleet)
        gone = requests.delete(f"{url}/v1/models/broken", headers=auth, timeout=5)
        assert gone.status_code == 202, gone.text
        text = scrape(fleet)  # no pass in between: the scrape reads what is true now
    finally:
        server.shutdown()
        server.server_close()
    assert series(text, "broken") == []
    assert 'llmgw_model_parked{model="kept"} 0.0' in text


def test_a_standby_publishes_no_fleet_series(fleet):
    assert "llmgw_nodes_up" not in scrape(fleet), "a leader before its first pass neither"
    fleet.tick()
    fleet.is_leading = False
    text = scrape(fleet)
    assert "llmgw_model_" not in text
    assert "llmgw_nodes_up" not in text
    fleet.is_leading = True
    assert 'llmgw_model_replicas_ready{model="kept"} 0.0' in scrape(fleet)


def test_a_replica_on_a_lost_node_is_counted_lost_not_ready(fleet):
    fleet.start_ready("a")
    assert 'llmgw_model_replicas_ready{model="kept"} 1.0' in scrape(fleet)
    fleet.crash("a")
    fleet.tick(fleet.cfg.scheduler.node_lost_s + 1)
    text = scrape(fleet)
    assert 'llmgw_model_replicas_ready{model="kept"} 0.0' in text
    assert 'llmgw_replicas{model="kept",state="lost"} 1.0' in text
    assert 'llmgw_replicas{model="kept",state="ready"} 0.0' in text
    assert 'llmgw_node_memory_available_bytes{node="a"}' not in text
    assert "llmgw_nodes_lost 1.0" in text
