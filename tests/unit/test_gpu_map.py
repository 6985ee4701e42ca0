"""Which replica holds each GPU: the admin API's nodes say it per GPU, `llmgw nodes --gpus`
shows it, and the scheduler publishes the free GPUs and each model's GPU need for the
GpusIdleWhileModelsWait alert. The real scheduler in process with a fake clock."""

import json

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from llmgw_ctl.main import cli
from llmgw_scheduler import admin, metrics
from llmgw_scheduler.fleet_api import View
from tests.fake_fleet import Fleet, GiB, model
from tests.helpers import free_port

TOKEN = "t" * 32
ECC = "2 uncorrectable ECC errors"


def gpus(healthy=(True, True, True)) -> list[dict]:
    return [{"index": i, "uuid": f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-58d2-4f0a", "name": "A100",
             "memory_total": 80 * GiB, "memory_free": 60 * GiB, "healthy": h,
             "health": "" if h else ECC, "mig": "Disabled"}
            for i, h in enumerate(healthy)]  # fmt: skip


@pytest.fixture
def fleet(tmp_path):
    """Node n: GPU 0 assigned to a ready replica of g, GPU 1 unhealthy, GPU 2 free."""
    f = Fleet(tmp_path, [model("g", memory=20 * GiB, min_=1, max_=1, gpus=1),
                         model("cpu", memory=GiB, min_=0, max_=1)])  # fmt: skip
    f.heartbeat("n", gpus=gpus((True, False, True)), kind="hello")
    f.tick()
    (start,) = [b for _, b in f.sent("start_shard")]
    f.shard("n", start["id"], "ready", gpus=start["gpus_assigned"])
    f.rid, f.held = start["id"], start["gpus_assigned"]
    yield f
    f.close()


def test_each_gpu_in_the_api_names_the_replica_assigned_it_or_none(fleet):
    with fleet.sched.lock:
        (node,) = View(fleet.sched).nodes()
    held = {g["uuid"]: (g["model"], g["replica"]) for g in node["gpus"]}
    assert fleet.held == ["GPU-00000000-58d2-4f0a"], "equally free: the lowest index"
    assert held == {"GPU-00000000-58d2-4f0a": ("g", fleet.rid),
                    "GPU-11111111-58d2-4f0a": (None, None),
                    "GPU-22222222-58d2-4f0a": (None, None)}  # fmt: skip


def llmgw(fleet, *args: str):
    server = admin.serve(fleet.sched, f"127.0.0.1:{free_port()}", TOKEN)
    env = {"LLMGW_ADMIN_URL": f"http://127.0.0.1:{server.server_address[1]}",
           "LLMGW_ADMIN_TOKEN": TOKEN}  # fmt: skip
    try:
        return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    finally:
        server.shutdown()
        server.server_close()


def test_nodes_gpus_prints_a_row_per_gpu_with_its_health_and_replica(fleet):
    result = llmgw(fleet, "nodes", "--gpus")
    assert result.exit_code == 0, result.output
    head, *rows = result.output.splitlines()
    assert head.split() == ["NODE", "GPU", "UUID", "NAME", "MEMORY", "GiB", "(USED/TOTAL)",
                            "HEALTH", "REPLICA"]  # fmt: skip
    assert [r.split()[:6] for r in rows] == [
        ["n", "0", "GPU-00000000", "A100", "20.0/80.0", "ok"],
        ["n", "1", "GPU-11111111", "A100", "20.0/80.0", "unhealthy:"],
        ["n", "2", "GPU-22222222", "A100", "20.0/80.0", "ok"],
    ]
    assert rows[0].endswith(f" g/{fleet.rid}") and rows[2].endswith(" -")
    assert f"unhealthy: {ECC}" in rows[1]


def test_nodes_list_gpus_json_is_one_object_per_gpu(fleet):
    result = llmgw(fleet, "nodes", "list", "--gpus", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert [(g["node"], g["index"], g["healthy"], g["replica"]) for g in body] == [
        ("n", 0, True, fleet.rid), ("n", 1, False, None), ("n", 2, True, None)]  # fmt: skip
    assert body[0]["model"] == "g" and body[0]["memory_used"] == 20 * GiB
    assert body[1]["health"] == ECC


def test_a_node_that_is_lost_shows_no_gpus(fleet):
    fleet.clock.advance(60)  # past node_lost_s with no heartbeat
    fleet.tick()
    result = llmgw(fleet, "nodes", "--gpus")
    assert result.exit_code == 0 and result.stdout == ""
    assert "no node reports a GPU" in result.output


def scrape(fleet) -> str:
    registry = CollectorRegistry()
    metrics.watch_fleet(fleet.sched, registry)
    return generate_latest(registry).decode()


def test_the_scheduler_publishes_free_gpus_per_node_and_each_model_s_gpu_need(fleet):
    text = scrape(fleet)
    assert 'llmgw_node_gpus_free{node="n"} 1.0' in text, "one held, one unhealthy"
    assert 'llmgw_model_gpus_needed{model="g"} 1.0' in text
    assert 'llmgw_model_gpus_needed{model="cpu"} 0.0' in text
    with fleet.sched.lock:
        fleet.sched.inv.nodes["n"].draining = True
    assert 'llmgw_node_gpus_free{node="n"} 0.0' in scrape(fleet), "a draining node takes none"
