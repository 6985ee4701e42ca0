"""Scheduler, agents and router together: placement, and surviving crashes of each piece."""

import json
import os
import signal
import time

import requests

from tests.helpers import eventually
from tests.system.conftest import GiB


def only_shard(cluster, node):
    shards = cluster.shards(node)
    return shards[0] if len(shards) == 1 else None


def test_a_model_is_placed_on_the_node_where_it_fits_and_served(served):
    assert only_shard(served, "node-a") is not None
    assert served.shards("node-b") == []
    resp = served.chat("m")
    assert resp.headers["x-llmgw-served-model"] == "m"
    eventually(
        lambda: served.metric('llmgw_model_replicas_ready{model="m"}') == 1, what="the ready metric"
    )
    assert served.metric("llmgw_nodes_up") == 2
    assert served.metric('llmgw_model_parked{model="m"}') == 0
    # No backup was ever made: the metric says 0, so "backup too old" can fire.
    assert (
        "llmgw_backup_last_success_timestamp_seconds 0.0"
        in requests.get(f"http://127.0.0.1:{served.sched_metrics}/metrics", timeout=5).text
    )


def test_an_agent_killed_hard_leaves_its_engine_serving_and_adopts_it_on_restart(served):
    before = only_shard(served, "node-a")
    engines = served.engine_pids()
    assert len(engines) == 1
    served.agents["node-a"].stop(signal.SIGKILL)
    assert served.serves("m"), "the engine must outlive its agent"
    served.start_agent("node-a", memory=2 * GiB)
    eventually(lambda: "adopted" in served.agents["node-a"].log(), what="the adoption")
    # Let a few scheduler passes go by: nothing may start a second engine.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert served.engine_pids() == engines
        assert served.serves("m")
    assert only_shard(served, "node-a")["pid"] == before["pid"]


def test_a_scheduler_killed_hard_leaves_routers_serving_and_starts_nothing_twice(served):
    engines = served.engine_pids()
    served.scheduler.stop(signal.SIGKILL)
    assert served.serves("m"), "the router keeps its last routing table"
    served.start_scheduler()
    eventually(
        lambda: served.metric('llmgw_model_replicas_ready{model="m"}') == 1,
        what="the new scheduler to learn the running replica",
    )
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert served.engine_pids() == engines
        assert served.serves("m")
    assert "start_replica" not in served.scheduler.log()


def test_an_engine_that_dies_is_replaced_after_backoff(served):
    (pid,) = served.engine_pids()
    first = only_shard(served, "node-a")["id"]
    os.killpg(pid, signal.SIGKILL)
    eventually(
        lambda: (s := only_shard(served, "node-a")) and s["id"] != first,
        timeout=30,
        what="a replacement replica",
    )
    eventually(lambda: served.serves("m"), timeout=30, what="the replacement to serve")
    assert "start_failed" in served.scheduler.log()


def test_a_node_that_stops_heartbeating_has_its_replicas_moved(cluster, api_key):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: only_shard(cluster, "node-a"), timeout=30, what="a replica on node-a")
    cluster.start_agent("node-b", memory=2 * GiB)
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 2, what="node-b to join")
    cluster.agents["node-a"].p.send_signal(signal.SIGSTOP)  # alive, but silent
    try:
        eventually(
            lambda: only_shard(cluster, "node-b"), timeout=30, what="the replica to move to node-b"
        )
        assert "node_lost" in cluster.scheduler.log()
        eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")
    finally:
        cluster.agents["node-a"].p.send_signal(signal.SIGCONT)


def test_an_agent_with_an_unregistered_key_is_refused(cluster, api_key):
    from llmgw import bus

    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    bus.create_keypair(cluster.etc / "pki" / "curve", "intruder")  # made, never registered
    cluster.start_agent("intruder", memory=4 * GiB, register=False)
    cluster.start_agent("node-a", memory=GiB // 2)  # registered, too small for m
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 1, what="node-a to join")
    eventually(lambda: "no_placement" in cluster.scheduler.log(), what="m to be unplaceable")
    assert cluster.shards("intruder") == []
    assert "intruder" not in cluster.scheduler.log()


def test_an_invalid_model_stops_the_scheduler_naming_the_model_and_the_field(cluster):
    import subprocess

    from tests.helpers import BIN

    cfg = cluster.tmp / "bad.toml"
    cfg.write_text(
        f'[paths]\nconfig_dir = "{cluster.etc}"\nstate_dir = "{cluster.tmp}/s"\n'
        '[[models]]\nname = "big"\nsource = "https://example.org/big.gguf"\n'
    )
    result = subprocess.run(
        [str(BIN / "llmgw-scheduler"), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: model 'big': sha256 is required for a https source, so a wrong file is never used"
    )


def test_a_model_that_always_fails_is_parked_and_clients_are_told_why_at_once(cluster, api_key):
    cluster.add_model("doomed", memory=GiB, engine="broken")
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(
        lambda: "model_parked" in cluster.scheduler.log(), timeout=60, what="the model to be parked"
    )
    assert cluster.scheduler.log().count("start_replica") == 5

    def told():
        resp = cluster.chat("doomed")
        return [resp] if resp.json()["error"]["code"] == "model_parked" else None

    (resp,) = eventually(told, what="the router to hear of the parking")
    assert resp.status_code == 503
    assert "Retry-After" not in resp.headers
    assert resp.headers["x-should-retry"] == "false"
    assert "bad magic" in resp.json()["error"]["message"]
    eventually(
        lambda: cluster.metric('llmgw_model_parked{model="doomed"}') == 1, what="the parked metric"
    )
    assert cluster.metric('llmgw_model_replicas_ready{model="doomed"}') == 0
    # Parked means parked: no more starts through many more passes (tick_s is 0.2 s).
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert cluster.scheduler.log().count("start_replica") == 5


def test_draining_a_node_moves_its_replicas_without_an_outage(cluster, api_key):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served on node-a")
    cluster.start_agent("node-b", memory=2 * GiB)
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 2, what="node-b to join")
    assert cluster.shards("node-b") == []

    result = cluster.ctl("drain", "node-a")
    assert result.returncode == 0 and "queued: drain node-a" in result.stderr
    # Poll throughout: the model must never stop answering while its replica moves.
    deadline = time.monotonic() + 60
    while cluster.shards("node-a") or not only_shard(cluster, "node-b"):
        assert time.monotonic() < deadline, "the replica did not move to node-b"
        assert cluster.serves("m"), "the model stopped answering during the drain"
    assert cluster.serves("m")
    nodes = {n["name"]: n["state"] for n in json.loads(cluster.ctl("nodes", "--json").stdout)}
    assert nodes == {"node-a": "draining", "node-b": "up"}
    assert cluster.ctl("undrain", "node-a").returncode == 0
    eventually(
        lambda: json.loads(cluster.ctl("nodes", "--json").stdout)[0]["state"] == "up",
        what="node-a to be undrained",
    )


def test_an_on_demand_model_starts_when_asked_for_and_stops_when_idle(cluster, api_key):
    import openai

    cluster.add_model("lazy", memory=GiB, min_=0, keep_alive=3.0)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 1, what="node-a to join")
    # Before its first table a router knows no model (issue 17, fault 2).
    eventually(lambda: "routes_applied" in cluster.router.log(), what="the router's table")
    assert cluster.shards("node-a") == [], "an on-demand model does not start by itself"

    # The first request waits while the model is placed and started, then is answered.
    client = openai.OpenAI(
        base_url=cluster.router_url + "/v1", api_key=cluster.secret, max_retries=0, timeout=30
    )
    reply = client.chat.completions.create(
        model="lazy", messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content
    assert len(cluster.shards("node-a")) == 1
    assert "model_wanted" in cluster.scheduler.log()

    # Idle past its keep-alive, it is stopped.
    eventually(lambda: cluster.shards("node-a") == [], timeout=30, what="the idle stop")
    assert cluster.engine_pids() == set()


def two_models_room_for_one(cluster, api_key, min_lifetime_s: float) -> None:
    """On-demand models "first" and "second" and one node with room for one of them at a
    time, serving through a router; "first" asked for and answered."""
    cluster.add_model("first", memory=GiB + GiB // 2, min_=0)
    cluster.add_model("second", memory=GiB + GiB // 2, min_=0)
    cluster.scheduler_extra = f"eviction_min_lifetime_s = {min_lifetime_s}\n"
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 1, what="node-a to join")
    # Before its first table a router knows no model (issue 17, fault 2).
    eventually(lambda: "routes_applied" in cluster.router.log(), what="the router's table")
    assert cluster.chat("first", timeout=30).status_code == 200


def test_a_wanted_on_demand_model_evicts_the_least_recently_used_one(cluster, api_key):
    two_models_room_for_one(cluster, api_key, min_lifetime_s=0.0)  # no minimum
    assert cluster.chat("second", timeout=30).status_code == 200
    assert "model_evicted model=first for_model=second" in cluster.scheduler.log()
    # The evicted engine finishes what it answers (nothing), then stops.
    eventually(
        lambda: [s["model"] for s in cluster.shards("node-a")] == ["second"],
        what="only the second model on node-a",
    )
    assert cluster.metric('llmgw_model_evictions_total{model="first"}') == 1


def test_two_on_demand_models_that_cannot_both_fit_no_longer_evict_each_other_in_turn(
    cluster, api_key
):
    two_models_room_for_one(cluster, api_key, min_lifetime_s=300.0)  # the default
    for _ in range(3):  # asked for in turn: first keeps its room, second is told why
        refused = cluster.chat("second", timeout=30)
        assert refused.status_code == 503, refused.text
        assert "retry-after" not in refused.headers
        error = refused.json()["error"]
        assert error["code"] == "model_unplaceable"
        assert "no room: first holds it and may not be evicted for another" in error["message"]
        assert "scheduler.eviction_min_lifetime_s = 300" in error["message"]
        assert cluster.chat("first", timeout=30).status_code == 200
    status = cluster.ctl("status")
    assert "first holds it and may not be evicted" in status.stdout, status.stdout
    log = cluster.scheduler.log()
    assert "model_evicted" not in log
    assert log.count("start_replica") == 1
    assert [s["model"] for s in cluster.shards("node-a")] == ["first"]
    assert cluster.metric('llmgw_model_evictions_total{model="first"}', default=None) == 0


def test_a_replica_s_idle_time_is_known_from_the_router_and_published(cluster, api_key):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")

    def idle():
        (r,) = cluster.admin("/v1/replicas")
        return r["id"], r["idle_s"]

    eventually(lambda: idle()[1] >= 3, timeout=30, what="the replica to be idle 3s")
    # The router reports it used at its next activity report; the idle time starts
    # again. Each poll sends a request, so the condition cannot be missed between two
    # polls on a loaded machine.
    eventually(
        lambda: cluster.serves("m") and idle()[1] < 3,
        timeout=30,
        what="a request to reset its idle time",
    )
    rid = idle()[0]
    text = requests.get(f"http://127.0.0.1:{cluster.sched_metrics}/metrics", timeout=5).text
    assert f'llmgw_replica_idle_seconds{{model="m",node="node-a",replica="{rid}"}}' in text
    assert "IDLE" in cluster.ctl("replicas").stdout


def test_a_wanted_model_that_fits_nowhere_is_refused_at_once_and_placed_once_room_comes(
    cluster, api_key
):
    cluster.add_model("big", memory=4 * GiB, min_=0)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])  # activation window: 20 s
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 1, what="node-a to join")
    eventually(lambda: "routes_applied" in cluster.router.log(), what="the router's table")
    started = time.monotonic()
    refused = cluster.chat("big", timeout=30)
    assert refused.status_code == 503, refused.text
    assert time.monotonic() - started < 10, "answered on the fresh attempt, not the window"
    assert refused.json()["error"]["code"] == "model_unplaceable"
    assert "needs 4 GiB" in refused.json()["error"]["message"]
    assert "Retry-After" not in refused.headers
    # Room comes: the next request is not refused on the last answer, it is served.
    cluster.start_agent("node-b", memory=8 * GiB)
    eventually(lambda: cluster.metric("llmgw_nodes_up") == 2, what="node-b to join")
    assert cluster.chat("big", timeout=30).status_code == 200
