"""Two schedulers on one real PostgreSQL store: one leads, one stands by, and the fleet
keeps serving whatever happens to the leader."""

import os
import re
import signal
import time

import psycopg2
import pytest

from tests.helpers import eventually
from tests.system.conftest import GiB, Traffic


@pytest.fixture
def pair(cluster, pg_store, api_key):
    """s1 leading, s2 standing by, two nodes serving model m (one replica each), a router."""
    cluster.add_scheduler("s2")
    cluster.add_model("m", memory=GiB, min_=2, max_=2)
    cluster.start_scheduler("s1")
    eventually(lambda: role(cluster, "s1") == "leader", what="s1 to lead")
    cluster.start_scheduler("s2")
    cluster.start_agent("node-a", memory=3 * GiB)
    cluster.start_agent("node-b", memory=3 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: ready(cluster, "s1") == 2, timeout=30, what="two ready replicas")
    eventually(lambda: cluster.serves("m"), what="m to be served")
    return cluster


def status(cluster, name):
    return cluster.admin("/v1/status", scheduler=name)["control_plane"]


def role(cluster, name) -> str:
    try:
        return status(cluster, name)["role"]
    except Exception:
        return "down"


def ready(cluster, name) -> int:
    return sum(1 for r in cluster.admin("/v1/replicas", scheduler=name) if r["state"] == "ready")


def started(cluster) -> list[str]:
    """Every replica id any scheduler asked an agent to start, once per ask."""
    ids = []
    for proc in cluster.schedulers.values():
        ids += re.findall(r": start_replica replica=(\S+)", proc.log())
    return ids


def test_the_standby_takes_over_a_killed_leader_and_nothing_is_started_twice(pair):
    epoch = status(pair, "s1")["epoch"]
    assert status(pair, "s2")["role"] == "standby"
    assert status(pair, "s2")["leader"]["name"] == "s1"
    # The standby says once whom it follows (it retries every 0.3 s, silently).
    line = eventually(lambda: [x for x in pair.schedulers["s2"].log().splitlines()
                               if "standing_by" in x], what="s2 to say it stands by")  # fmt: skip
    assert f"leader=s1 epoch={epoch}" in line[0]
    before = {r["id"] for r in pair.admin("/v1/replicas")}
    traffic = Traffic(pair)
    eventually(lambda: traffic.ok > 5, what="traffic to flow")

    pair.schedulers["s1"].p.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    # lease 3 s + standby retry 0.3 s, with room for a loaded machine.
    eventually(lambda: role(pair, "s2") == "leader", timeout=15, what="s2 to lead")
    took = time.monotonic() - t0
    assert status(pair, "s2")["epoch"] == epoch + 1
    # The new leader places work: a third replica, through its admin API.
    assert pair.ctl("scale", "m", "--min", "3", "--max", "3", scheduler="s2").returncode == 0
    eventually(lambda: ready(pair, "s2") == 3, timeout=30, what="a third replica")
    traffic.stop()

    assert traffic.failed == [], f"requests failed during the failover: {traffic.failed[:5]}"
    assert pair.schedulers["s2"].log().count("standing_by") == 1
    ids = started(pair)
    assert len(ids) == len(set(ids)) == 3, f"a replica was started twice: {ids}"
    after = {r["id"] for r in pair.admin("/v1/replicas", scheduler="s2")}
    assert before < after  # the old replicas were adopted, not restarted
    print(f"takeover seen {took:.1f}s after the kill")


def test_a_leader_stopped_past_its_lease_steps_down_when_it_wakes_and_acts_no_more(pair):
    epoch = status(pair, "s1")["epoch"]
    s1 = pair.schedulers["s1"]
    s1.p.send_signal(signal.SIGSTOP)
    try:
        eventually(lambda: role(pair, "s2") == "leader", timeout=15, what="s2 to lead")
        assert status(pair, "s2")["epoch"] == epoch + 1
        # The agents learn the new epoch from the new leader at once.
        eventually(
            lambda: all(
                "leader_epoch epoch=" + str(epoch + 1) in a.log() for a in pair.agents.values()
            ),
            what="the agents to see the new epoch",
        )
        woke_at = len(s1.log())
    finally:
        s1.p.send_signal(signal.SIGCONT)
    eventually(lambda: ": stepped_down " in s1.log()[woke_at:], what="s1 to step down")
    eventually(lambda: role(pair, "s1") == "standby", what="s1 to say it stands by")
    # Everything s1 did after waking: no start, no stop, and its metric says standby.
    assert not re.search(r": (start|stop)_replica ", s1.log()[woke_at:])
    leader = 'llmgw_control_plane_leader{scheduler="%s"}'
    assert pair.metric(leader % "s1", scheduler="s1", default=None) == 0
    assert pair.metric(leader % "s2", scheduler="s2", default=None) == 1
    # A standby publishes no fleet series, so no model alert fires twice.
    with pytest.raises(AssertionError, match="is not published by s1"):
        pair.metric('llmgw_model_replicas_ready{model="m"}', scheduler="s1", default=None)
    # The new leader publishes them once it has settled (fresh heartbeats first).
    eventually(
        lambda: pair.metric('llmgw_model_replicas_ready{model="m"}', scheduler="s2") == 2,
        what="s2 to publish the fleet's series",
    )
    # A change sent to the deposed leader is answered with who leads now.
    result = pair.ctl("retry", "m", scheduler="s1")
    assert result.returncode == 1
    assert f"the leader is s2 at http://127.0.0.1:{pair.sched_ports['s2']['admin']}" in (
        result.stderr
    )
    assert pair.serves("m")


def test_a_leader_whose_database_connections_are_killed_never_leaves_two_leaders(pair):
    s1 = pair.schedulers["s1"]
    conn = psycopg2.connect(os.environ["LLMGW_TEST_POSTGRES"])
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            (f"llmgw-scheduler:{s1.p.pid}",),
        )
        assert len(cur.fetchall()) >= 2  # its lease thread's and its loop's, at least
    finally:
        conn.close()
    # Watch both for longer than a lease: never two leaders at once.
    seen = []
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        roles = (role(pair, "s1"), role(pair, "s2"))
        seen.append(roles)
        assert roles.count("leader") <= 1, f"two leaders: {roles}"
    assert seen[-1].count("leader") == 1, f"nobody leads at the end: {seen[-3:]}"
    assert ": lease_store_failed " in s1.log()  # it did lose its connection
    assert pair.serves("m")


def test_with_no_scheduler_at_all_the_fleet_keeps_serving_and_a_new_one_restarts_nothing(pair):
    replicas = {r["id"] for r in pair.admin("/v1/replicas")}
    engines = pair.engine_pids()
    for name in ("s2", "s1"):
        pair.schedulers[name].stop()
    for _ in range(20):  # routers keep their last table, engines keep running
        assert pair.serves("m")
    assert pair.engine_pids() == engines

    pair.start_scheduler("s2")  # a fresh log
    eventually(lambda: role(pair, "s2") == "leader", timeout=15, what="s2 to lead")
    eventually(lambda: ready(pair, "s2") == 2, timeout=15, what="the replicas to be adopted")
    # Published at the end of a full pass, after the settle time: it has decided.
    eventually(
        lambda: pair.metric('llmgw_model_replicas_desired{model="m"}', scheduler="s2") == 2,
        what="a full pass by s2",
    )
    assert {r["id"] for r in pair.admin("/v1/replicas", scheduler="s2")} == replicas
    assert "start_replica" not in pair.schedulers["s2"].log()
    assert pair.engine_pids() == engines
    assert pair.serves("m")


def test_with_sqlite_a_second_scheduler_refuses_to_start_and_the_epoch_rises_on_every_start(
    cluster,
):
    cluster.add_scheduler("s2")
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler("s1")
    eventually(lambda: role(cluster, "s1") == "leader", what="s1 to lead")
    assert status(cluster, "s1")["epoch"] == 1
    with pytest.raises(AssertionError) as refused:
        cluster.start_scheduler("s2")
    assert "exited 1" in str(refused.value)
    log = (cluster.tmp / "scheduler-s2.log").read_text()
    assert "another llmgw-scheduler (s1, pid " in log
    assert "SQLite allows one scheduler: use PostgreSQL for a standby" in log

    cluster.schedulers["s1"].p.send_signal(signal.SIGKILL)  # no clean hand-over
    cluster.schedulers["s1"].stop()
    cluster.start_scheduler("s1")
    eventually(lambda: role(cluster, "s1") == "leader", what="s1 to lead again")
    assert status(cluster, "s1")["epoch"] == 2


def test_a_removed_node_is_forgotten_by_both_schedulers_and_not_brought_back_by_a_takeover(pair):
    names = lambda s: [n["name"] for n in pair.admin("/v1/nodes", scheduler=s)]  # noqa: E731
    assert "node-b" in names("s2")  # the standby hears every agent too
    result = pair.ctl("nodes", "remove", "node-b", "--force")
    assert result.returncode == 0, result.stderr
    # Gone at once on the scheduler that removed it, with its replica: not `lost`.
    assert names("s1") == ["node-a"]
    placement = pair.admin("/v1/models/m/placement")
    assert [n["name"] for n in placement["nodes"]] == ["node-a"]
    assert all(r["node"] == "node-a" for r in pair.admin("/v1/replicas"))
    # The standby learns it from the store at its next look (2 s).
    eventually(lambda: names("s2") == ["node-a"], timeout=10, what="s2 to forget node-b")
    # The catalog still wants two: the second goes on node-a, not back on node-b.
    eventually(lambda: ready(pair, "s1") == 2, timeout=30, what="a replacement on node-a")

    pair.schedulers["s1"].p.send_signal(signal.SIGKILL)
    eventually(lambda: role(pair, "s2") == "leader", timeout=15, what="s2 to lead")
    took = eventually(lambda: [x for x in pair.schedulers["s2"].log().splitlines()
                               if ": took_over " in x], what="s2 to say it took over")  # fmt: skip
    assert " nodes=1 " in took[0], took[0]
    # Past node_lost_s (3 s) after the takeover, node-b is still nowhere, not even lost.
    eventually(lambda: pair.metric("llmgw_nodes_up", scheduler="s2") == 1,
               what="s2 to publish its nodes")  # fmt: skip
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert names("s2") == ["node-a"]
        assert pair.metric("llmgw_nodes_lost", scheduler="s2") == 0
    assert all(r["node"] == "node-a" for r in pair.admin("/v1/replicas", scheduler="s2"))


@pytest.fixture
def slow_lease(cluster, pg_store):
    """s1 leading and s2 standing by, no nodes, with a lease long enough to look at a
    leader that stopped answering while its lease still runs."""
    cluster.lease = "lease_s = 12.0\nrenew_s = 0.5\nstep_down_s = 2.0\nstandby_retry_s = 0.3\n"
    cluster.add_scheduler("s2")
    cluster.start_scheduler("s1")
    eventually(lambda: role(cluster, "s1") == "leader", what="s1 to lead")
    cluster.start_scheduler("s2")
    eventually(lambda: role(cluster, "s2") == "standby", what="s2 to stand by")
    return cluster


def test_status_through_the_standby_says_a_silent_leader_is_presumed_down_and_who_takes_over(
    slow_lease,
):
    cluster = slow_lease
    epoch = status(cluster, "s1")["epoch"]
    line = cluster.ctl("status", scheduler="s2").stdout.splitlines()[0]
    assert line.startswith(f"LEADER s1 (epoch {epoch}, lease "), line
    assert "presumed down" not in line

    s1 = cluster.schedulers["s1"]
    s1.p.send_signal(signal.SIGSTOP)  # alive, holding its lease, saying nothing
    try:
        first = eventually(
            lambda: (x := cluster.ctl("status", scheduler="s2").stdout.splitlines()[0])
            and "presumed down" in x and x,
            timeout=8, what="the standby to say the leader is presumed down",
        )  # fmt: skip
        assert re.match(
            rf"LEADER s1 \(epoch {epoch}, not seen for [\d.]+s: presumed down; "
            r"lease [\d.]+s left, s2 takes over when it runs out\)  STANDBY s2 \(seen",
            first,
        ), first
        assert first.endswith("[answered by s2, standby]"), first
        cp = status(cluster, "s2")
        assert cp["leader"]["presumed_down"] is True and cp["leader"]["seen_s_ago"] > 0.75
        eventually(lambda: role(cluster, "s2") == "leader", timeout=20, what="s2 to lead")
        line = cluster.ctl("status", scheduler="s2").stdout.splitlines()[0]
        assert line.startswith(f"LEADER s2 (epoch {epoch + 1}, lease "), line
    finally:
        s1.p.send_signal(signal.SIGCONT)
