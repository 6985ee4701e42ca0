"""`llmgw restart`: replicas replaced one by one, the model answering throughout."""

import json
import time

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
    replicas = cluster.admin("/v1/replicas")
    assert [(r["stale"], r["id"] != old) for r in replicas] == [(False, True)]


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
