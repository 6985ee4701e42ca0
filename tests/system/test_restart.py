"""`llmgw restart`: replicas replaced one by one, the model answering throughout."""

import json
import threading
import time

import requests

from tests.helpers import eventually
from tests.system.conftest import GiB


def ready_ids(cluster, model="m") -> set[str]:
    return {r["id"] for r in cluster.admin(f"/v1/replicas?model={model}") if r["state"] == "ready"}


def test_restarting_a_model_on_two_nodes_never_leaves_it_without_a_ready_replica(cluster, api_key):
    cluster.add_model("m", memory=GiB, min_=2, max_=2)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=3 * GiB)
    cluster.start_agent("node-b", memory=3 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: len(ready_ids(cluster)) == 2, timeout=30, what="two ready replicas")
    before = ready_ids(cluster)

    result = cluster.ctl("restart", "--model", "m", "--json")
    assert result.returncode == 0, result.stderr
    queued = json.loads(result.stdout)
    assert {j["replica"] for j in queued} == before
    assert {j["state"] for j in queued} == {"queued"}

    # Poll throughout: a ready replica and an answer at every step, until both are new.
    seen_marks = set()
    deadline = time.monotonic() + 90
    while True:
        replicas = cluster.admin("/v1/replicas?model=m")
        seen_marks |= {r["restart"] for r in replicas if r["restart"]}
        now_ready = {r["id"] for r in replicas if r["state"] == "ready"}
        assert now_ready, f"no ready replica during the restart: {replicas}"
        assert cluster.serves("m"), "the model stopped answering during the restart"
        if len(now_ready) == 2 and not now_ready & before:
            break
        assert time.monotonic() < deadline, f"the restart did not finish: {replicas}"
    assert "replacing" in seen_marks
    jobs = {j["replica"]: j for j in cluster.admin("/v1/restarts")}
    eventually(
        lambda: all(cluster.admin("/v1/restarts")[i]["state"] == "done" for i in range(2)),
        what="both restarts to be recorded done",
    )
    assert {jobs[r]["how"] for r in before} == {"surge"}


def test_a_replica_with_only_itself_in_the_way_is_replaced_in_place(cluster, api_key):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=GiB + GiB // 2)  # no room for a second one
    cluster.start_router(api_key[1])
    eventually(lambda: len(ready_ids(cluster)) == 1, timeout=30, what="a ready replica")
    (old,) = ready_ids(cluster)

    result = cluster.ctl("restart", old, "--wait", "--timeout", "60")
    assert result.returncode == 0, result.stderr
    assert "in place" in result.stdout and "done" in result.stdout
    eventually(lambda: ready_ids(cluster) - {old}, timeout=30, what="a new ready replica")
    assert old not in ready_ids(cluster)
    eventually(lambda: cluster.serves("m"), what="the model to answer again")


def test_a_replica_started_before_its_profile_changed_is_marked_stale_until_restarted(
    cluster, api_key
):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=3 * GiB)
    eventually(lambda: len(ready_ids(cluster)) == 1, timeout=30, what="a ready replica")
    (old,) = ready_ids(cluster)
    assert cluster.admin("/v1/replicas")[0]["stale"] is False

    cluster.scheduler.stop()
    cluster.models[0]["profile"] = "context = 8192\n"
    cluster.start_scheduler()
    eventually(
        lambda: [r["stale"] for r in cluster.admin("/v1/replicas")] == [True],
        timeout=30,
        what="the adopted replica to be marked stale",
    )
    assert "(stale)" in cluster.ctl("replicas").stdout

    stale = cluster.ctl("replicas", "--json")
    ids = [r["id"] for r in json.loads(stale.stdout) if r["stale"]]
    assert ids == [old]
    assert cluster.ctl("restart", *ids, "--wait", "--timeout", "60").returncode == 0
    # Done once the replacement is ready; the old one drains, then goes.
    eventually(
        lambda: (
            [(r["stale"], r["id"] != old) for r in cluster.admin("/v1/replicas")] == [(False, True)]
        ),
        what="only the fresh replica",
    )


def test_restarting_what_does_not_run_is_a_one_line_error(cluster):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    result = cluster.ctl("restart", "r-nosuch")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: no running replica 'r-nosuch' (see `llmgw replicas`)"
    ]
    result = cluster.ctl("restart", "--model", "nosuch")
    assert result.returncode == 1 and "no model 'nosuch'" in result.stderr
    result = cluster.ctl("restart")
    assert result.returncode == 2 and "--model M, or --all" in result.stderr
    result = cluster.ctl("restart", "--all", "--in-place", "--max-unavailable", "0")
    assert result.returncode == 2 and "--in-place needs --max-unavailable" in result.stderr


def test_a_stream_in_flight_on_a_restarted_replica_is_finished_before_its_engine_stops(
    cluster, api_key
):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=3 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")
    (old,) = cluster.admin("/v1/replicas")
    # A slow stream: 20 chunks, 0.15 s apart.
    requests.post(old["endpoint"] + "/_control", json={"chunks": 20, "delay_s": 0.15}, timeout=5)
    chunks = []

    def stream():
        with requests.post(
            f"{cluster.router_url}/v1/chat/completions",
            json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {cluster.secret}"},
            stream=True,
            timeout=30,
        ) as r:
            chunks.extend(line for line in r.iter_lines() if line.startswith(b"data: "))

    reader = threading.Thread(target=stream)
    reader.start()
    eventually(lambda: chunks, what="the stream to begin")
    assert cluster.ctl("restart", old["id"]).returncode == 0
    reader.join(timeout=60)
    assert chunks[-1] == b"data: [DONE]"
    assert len(chunks) == 21, chunks  # every chunk, then [DONE]: nothing was cut off
    eventually(
        lambda: old["id"] not in {r["id"] for r in cluster.admin("/v1/replicas")},
        timeout=30,
        what="the old replica to be gone",
    )
    log = cluster.agents["node-a"].log()
    assert f"shard_draining shard={old['id']}" in log
    assert log.index(f"shard_draining shard={old['id']}") < log.index(
        f"shard_stopped shard={old['id']}"
    )
