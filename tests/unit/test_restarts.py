"""Restart decisions, pass by pass, with a fake clock."""

from llmgw.placement import GiB, Need, NodeView, gpus_of
from llmgw.reconciler import ReplicaView
from llmgw.restarts import DONE, GIVEN_UP, IN_PLACE, QUEUED, REPLACING, SURGE, Restart, plan

LLAMA = "llama.cpp-0.3.36"
NEEDS = {"m": Need("m", 4 * GiB, 0, LLAMA), "n": Need("n", 4 * GiB, 0, LLAMA)}
TIMEOUT = 100.0


def node(id, gib=16, **kw) -> NodeView:
    return NodeView(id, memory_free=gib * GiB, engines={LLAMA: "installed"}, **kw)


def rep(id, model="m", node="a", state="ready", since=0.0) -> ReplicaView:
    return ReplicaView(id, model, node, state, since)


def job(replica, model="m", node="a", **kw) -> Restart:
    return Restart(replica, model, node, queued_at=0.0, **kw)


def as_dict(*reps):
    return {r.id: r for r in reps}


def test_a_replica_is_replaced_beside_itself_and_stopped_only_once_the_replacement_is_ready():
    j = job("r1")
    replicas = as_dict(rep("r1"))
    nodes = [node("a", replicas={"m": 1}), node("b")]
    steps = plan([j], replicas, nodes, NEEDS, 10.0, TIMEOUT)
    assert [(s.replica, n) for s, n in steps.surge] == [("r1", "b")]
    assert (j.state, j.how) == (REPLACING, SURGE)
    assert steps.stop_now == [] and steps.retire == []

    j.replacement = "r2"
    replicas["r2"] = rep("r2", node="b", state="starting")
    steps = plan([j], replicas, [node("a"), node("b")], NEEDS, 11.0, TIMEOUT)
    assert (steps.surge, steps.retire, steps.ended) == ([], [], [])  # r1 keeps serving

    replicas["r2"] = rep("r2", node="b", state="ready")
    steps = plan([j], replicas, [node("a"), node("b")], NEEDS, 12.0, TIMEOUT)
    assert steps.retire == [j]
    assert j.state == DONE


def test_replicas_of_one_model_are_restarted_one_at_a_time_by_default():
    jobs = [job("r1"), job("r2", node="b")]
    replicas = as_dict(rep("r1"), rep("r2", node="b"))
    steps = plan(jobs, replicas, [node("a"), node("b")], NEEDS, 10.0, TIMEOUT)
    assert [s.replica for s, _ in steps.surge] == ["r1"]
    assert jobs[1].state == QUEUED


def test_max_surge_lets_several_replacements_start_at_once():
    jobs = [job("r1", max_surge=2), job("r2", node="b", max_surge=2)]
    replicas = as_dict(rep("r1"), rep("r2", node="b"))
    steps = plan(jobs, replicas, [node("a"), node("b")], NEEDS, 10.0, TIMEOUT)
    assert sorted(s.replica for s, _ in steps.surge) == ["r1", "r2"]


def test_other_models_restart_alongside():
    jobs = [job("r1"), job("s1", model="n")]
    replicas = as_dict(rep("r1"), rep("s1", model="n"))
    steps = plan(jobs, replicas, [node("a", gib=64)], NEEDS, 10.0, TIMEOUT)
    assert sorted(s.replica for s, _ in steps.surge) == ["r1", "s1"]


def test_where_only_the_old_replica_is_in_the_way_it_is_stopped_and_replaced_in_place():
    j = job("r1")
    replicas = as_dict(rep("r1"), rep("r2", node="b"))
    # 2 GiB free beside it: a 4 GiB replacement fits only once r1's 4 GiB are back.
    nodes = [node("a", gib=2), node("b", gib=1)]
    steps = plan([j], replicas, nodes, NEEDS, 10.0, TIMEOUT)
    assert steps.surge == [] and steps.stop_now == [j]
    assert (j.state, j.how, j.ready_before) == (REPLACING, IN_PLACE, 2)

    # Stopping, then gone: not done until the model is back to two ready replicas.
    del replicas["r1"]
    steps = plan([j], replicas, nodes, NEEDS, 20.0, TIMEOUT)
    assert j.state == REPLACING and steps.ended == []
    replicas["r3"] = rep("r3", state="ready")
    plan([j], replicas, nodes, NEEDS, 30.0, TIMEOUT)
    assert j.state == DONE


def test_where_nothing_would_fit_even_without_it_the_restart_is_given_up_with_the_reason():
    # Its profile was edited to need 64 GiB; the old replica holds 4.
    j = job("r1")
    big = {"m": Need("m", 64 * GiB, 0, LLAMA)}
    replicas = as_dict(rep("r1"))
    steps = plan([j], replicas, [node("a", gib=2)], big, 10.0, TIMEOUT, holds={"r1": 4 * GiB})
    assert steps.stop_now == [] and steps.surge == []
    assert j.state == GIVEN_UP
    assert "nothing would fit even without it" in j.reason and "a:" in j.reason


def test_max_unavailable_zero_never_stops_a_replica_before_its_replacement():
    j = job("r1", max_unavailable=0)
    steps = plan([j], as_dict(rep("r1")), [node("a", gib=2)], NEEDS, 10.0, TIMEOUT)
    assert steps.stop_now == []
    assert j.state == GIVEN_UP and "--max-unavailable 0" in j.reason


def test_in_place_stops_first_even_where_a_replacement_would_fit_beside():
    j = job("r1", in_place=True)
    steps = plan([j], as_dict(rep("r1")), [node("a", gib=64)], NEEDS, 10.0, TIMEOUT)
    assert steps.surge == [] and steps.stop_now == [j]


def test_a_restart_waits_for_a_surge_slot_rather_than_take_the_replica_down():
    jobs = [job("r1"), job("r2", node="b", max_unavailable=5)]
    replicas = as_dict(rep("r1"), rep("r2", node="b"))
    jobs[0].max_unavailable = 5
    steps = plan(jobs, replicas, [node("a"), node("b")], NEEDS, 10.0, TIMEOUT)
    assert [s.replica for s, _ in steps.surge] == ["r1"]
    assert steps.stop_now == [] and jobs[1].state == QUEUED


def test_a_replacement_that_fails_gives_the_restart_up_and_the_old_one_keeps_serving():
    j = job("r1", state=REPLACING, how=SURGE, replacement="r2", since=10.0)
    steps = plan([j], as_dict(rep("r1")), [node("a")], NEEDS, 20.0, TIMEOUT)
    assert steps.retire == [] and j.state == GIVEN_UP
    assert "r2 failed to start" in j.reason


def test_a_replacement_never_ready_is_given_up_after_the_timeout():
    j = job("r1", state=REPLACING, how=SURGE, replacement="r2", since=10.0)
    replicas = as_dict(rep("r1"), rep("r2", node="b", state="starting"))
    plan([j], replicas, [node("a")], NEEDS, 10.0 + TIMEOUT - 1, TIMEOUT)
    assert j.state == REPLACING
    plan([j], replicas, [node("a")], NEEDS, 10.0 + TIMEOUT + 1, TIMEOUT)
    assert j.state == GIVEN_UP and "not ready within" in j.reason


def test_a_replica_gone_before_its_turn_ends_its_restart():
    j = job("r1")
    steps = plan([j], {}, [node("a")], NEEDS, 10.0, TIMEOUT)
    assert j.state == DONE and steps.ended == [j] and steps.surge == []


def test_max_surge_0_stops_first_then_the_successor_starts_even_with_room_beside():
    jobs = [job("r1", max_surge=0, max_unavailable=1), job("r2", node="b", max_surge=0)]
    replicas = as_dict(rep("r1"), rep("r2", node="b"))
    nodes = [node("a", gib=64), node("b", gib=64)]  # room beside both
    steps = plan(jobs, replicas, nodes, NEEDS, 10.0, TIMEOUT)
    assert steps.surge == [] and steps.stop_now == [jobs[0]]
    assert (jobs[0].how, jobs[1].state) == (IN_PLACE, QUEUED)  # one unavailable at a time


def test_max_unavailable_n_with_max_surge_0_stops_n_at_once():
    jobs = [job(f"r{i}", node=f"n{i}", max_surge=0, max_unavailable=2) for i in range(3)]
    replicas = as_dict(*(rep(f"r{i}", node=f"n{i}") for i in range(3)))
    nodes = [node(f"n{i}", gib=64) for i in range(3)]
    steps = plan(jobs, replicas, nodes, NEEDS, 10.0, TIMEOUT)
    assert [j.replica for j in steps.stop_now] == ["r0", "r1"]
    assert jobs[2].state == QUEUED


def test_a_queued_restart_that_waits_past_its_deadline_is_given_up_with_the_reason():
    stuck = job("r1")  # in flight, and stays so: its own timeout is far off
    stuck.state, stuck.how, stuck.since, stuck.replacement = REPLACING, SURGE, 0.0, "r9"
    behind = job("r2", node="b")
    replicas = as_dict(rep("r1"), rep("r2", node="b"), rep("r9", node="c", state="starting"))
    nodes = [node("a"), node("b"), node("c")]
    steps = plan([stuck, behind], replicas, nodes, NEEDS, 50.0, 1e9, deadline_s=60)
    assert behind.state == QUEUED and steps.ended == []
    steps = plan([stuck, behind], replicas, nodes, NEEDS, 61.0, 1e9, deadline_s=60)
    assert behind.state == GIVEN_UP and steps.ended == [behind]
    assert "waited 60s in the queue" in behind.reason
    assert "scheduler.restart_deadline_s" in behind.reason


def test_the_deadline_counts_from_the_model_s_last_restart_not_from_the_queue():
    first, second = job("r1"), job("r2", node="b")
    replicas = as_dict(rep("r1"), rep("r2", node="b"))
    nodes = [node("a"), node("b"), node("c")]
    plan([first, second], replicas, nodes, NEEDS, 50.0, 1e9, deadline_s=60)
    assert first.state == REPLACING  # the model's restarts moved at 50
    first.replacement = "r9"
    replicas["r9"] = rep("r9", node="c", state="starting")
    plan([first, second], replicas, nodes, NEEDS, 100.0, 1e9, deadline_s=60)
    assert second.state == QUEUED  # 50 s since the model last moved, not 100


GPU = "vllm-0.8.5"


def test_a_gpu_model_on_a_full_gpu_node_is_restarted_in_place_counting_its_freed_gpus():
    needs = {"g": Need("g", 20 * GiB, 1, GPU)}
    j = job("r1", model="g", in_place=True)
    replicas = as_dict(rep("r1", model="g"))
    # One 24 GiB GPU, 22 GiB of it held by r1; plenty of host memory.
    nodes = [NodeView("a", memory_free=64 * GiB, gpus=gpus_of(2 * GiB),
                      engines={GPU: "installed"}, replicas={"g": 1})]  # fmt: skip
    steps = plan([j], replicas, nodes, needs, 10.0, TIMEOUT)
    assert steps.stop_now == [j], j.reason
    assert (j.state, j.how) == (REPLACING, IN_PLACE)
