"""Which failures count toward parking, and what a standby says: the real scheduler in
process, with a fake clock and agents that are only their messages."""

import logging

import pytest

from tests.fake_fleet import Fleet, model


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, [model("m")])
    f.heartbeat("a", kind="hello")
    f.heartbeat("b", kind="hello")
    yield f
    f.close()


def failures(fleet, name="m") -> int:
    b = fleet.sched.backoff.get(name)
    return b.failures if b else 0


def crash_and_return(fleet, node: str, rid: str) -> None:
    """The node dies; once lost it comes back, and its agent reports the engine gone
    (`not running after agent restart`), as after a reboot."""
    fleet.crash(node)
    lose(fleet, node)
    # The restarted agent's adoption reports the engine gone before its first hello.
    fleet.shard(node, rid, "failed", "not running after agent restart")
    fleet.heartbeat(node, kind="hello")


def lose(fleet, node: str) -> None:
    """Time passes past node_lost_s; every node but `node` keeps heartbeating."""
    for _ in range(int(fleet.cfg.scheduler.node_lost_s) + 2):
        fleet.tick(1)
        for other in fleet.sched.inv.nodes:
            if other != node:
                fleet.heartbeat(other)
    assert fleet.sched.inv.nodes[node].lost


def test_five_node_crashes_do_not_park_a_healthy_model(fleet):
    node = "a"
    rid = fleet.start_ready(node)
    for _ in range(6):
        crash_and_return(fleet, node, rid)
        assert failures(fleet) == 0
        # Its replacement went to the other node while this one was lost.
        (node, rid), *_ = [(r.node, r.id) for r in fleet.sched.inv.replicas.values()]
        fleet.shard(node, rid, "ready")
    assert "m" not in fleet.sched.parked


def test_a_node_crash_whose_replica_vanished_from_the_heartbeat_is_no_failed_start(fleet):
    rid = fleet.start_ready("a")
    fleet.crash("a")
    lose(fleet, "a")
    fleet.heartbeat("a", kind="hello")  # a new machine: no state file, no report of rid
    assert rid not in fleet.sched.inv.replicas
    assert failures(fleet) == 0


def test_a_start_the_engine_failed_counts_and_five_park_the_model(fleet):
    for i in range(5):
        fleet.clock.advance(400)  # past any backoff
        fleet.heartbeat("a")
        fleet.heartbeat("b")
        fleet.tick()
        (node, body), *_ = fleet.sent("start_shard")
        fleet.shard(node, body["id"], "failed", "error loading model: bad magic")
        assert failures(fleet) == i + 1
    assert "m" in fleet.sched.parked
    assert "bad magic" in fleet.sched.parked["m"].reason


def test_a_standby_logs_no_start_failed(tmp_path, caplog):
    caplog.set_level("INFO")
    f = Fleet(tmp_path, [model("m")], leading=False)
    try:
        f.heartbeat("a", kind="hello")
        f.shard("a", "r-1", "starting", model="m")
        f.shard("a", "r-1", "failed", "error loading model: bad magic")
        f.tick()
    finally:
        f.close()
    err = caplog.text
    assert "replica_state" in err  # it did hear of it
    assert "start_failed" not in err
    assert "retry_in_s" not in err


def test_an_agent_restart_that_finds_its_engine_gone_is_no_failed_start(fleet):
    rid = fleet.start_ready("a")  # the node rebooted faster than node_lost_s
    fleet.shard("a", rid, "failed", "not running after agent restart")
    assert failures(fleet) == 0


def test_an_engine_that_dies_after_serving_backs_off_like_any_engine_failure(fleet):
    rid = fleet.start_ready("a")
    fleet.shard("a", rid, "failed", "Segmentation fault")
    assert failures(fleet) == 1


def test_a_replica_s_state_is_logged_once_per_change_not_when_only_its_endpoint_moves(
    fleet, caplog
):
    caplog.set_level(logging.INFO, logger="llmgw")
    fleet.tick()
    ((node, start),) = fleet.sent("start_shard")
    rid = start["id"]
    fleet.shard(node, rid, "starting", endpoint="")
    fleet.shard(node, rid, "starting", endpoint=f"http://{node}:9001")  # its port, now known
    fleet.shard(node, rid, "ready", endpoint=f"http://{node}:9001")
    lines = [r.getMessage() for r in caplog.records if "replica_state" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "state=starting" in lines[0] and "state=ready was=starting" in lines[1]
    assert not any("state=starting was=starting" in line for line in lines)
