"""The invariant counts of a partition table, from logs and what clients saw (pure)."""

from tests.chaos.traffic import CUT, FAILED, OK, Sent

from .report import LeaderWatch, Result, leading_intervals, table

S1 = """100.000 INFO llmgw-scheduler: leading name=s1 epoch=1
104.000 INFO llmgw-scheduler: node_up node=a1
112.500 WARNING llmgw-scheduler: stepped_down epoch=1 reason="x y" stopped_s_ago=10.5
"""


def test_an_agent_that_obeys_an_older_epoch_after_a_newer_one_is_counted_stale():
    r = Result("split")
    r.epochs({
        "a1": "DEBUG llmgw-agentd: command_accepted type=start_shard epoch=1\n"
              "DEBUG llmgw-agentd: command_accepted type=stop_shard epoch=2\n"
              "DEBUG llmgw-agentd: command_accepted type=start_shard epoch=1\n",
        "a2": "DEBUG llmgw-agentd: command_accepted type=start_shard epoch=2\n",
    })  # fmt: skip
    assert r.stale == 1 and "a1 accepted start_shard of epoch 1 after 2" in r.broken[0]


def test_a_replica_id_started_twice_by_schedulers_or_agents_is_counted_once():
    r = Result("cut")
    r.starts(
        "INFO llmgw-scheduler: start_replica replica=r-1 model=m node=a1\n"
        "INFO llmgw-scheduler: start_replica replica=r-2 model=m node=a2\n",
        "INFO llmgw-agentd: shard_process_started shard=r-1 pid=1\n"
        "INFO llmgw-agentd: shard_process_started shard=r-1 pid=2\n",
    )
    assert r.started_twice == 1 and r.broken == ["replicas started twice: ['r-1']"]


def test_answers_are_matched_to_usage_rows_and_only_failures_break_the_run():
    sent = [Sent("q1", "run", False, outcome=OK), Sent("q2", "run", True, outcome=OK),
            Sent("q3", "run", True, outcome=CUT), Sent("q4", "run", False, outcome=FAILED,
                                                       detail="HTTP 503")]  # fmt: skip
    r = Result("cut")
    r.clients(sent, ["q1", "q1", "q3", "elsewhere"])
    assert (r.sent, r.answered, r.cut, r.failed) == (4, 2, 1, 1)
    assert (r.rows, r.missing, r.twice) == (3, 1, 1)
    assert len(r.broken) == 2 and "q4: HTTP 503" in r.broken[0]
    assert "| cut | 4 | 2 | 1 | 1 | 3 | 1 | 1 |" in table([r])


def test_a_leader_that_logs_its_step_down_late_led_only_until_it_stopped_acting():
    assert leading_intervals(S1) == [(1, 100.0, 102.0)]
    s2 = "103.100 INFO llmgw-scheduler: leading name=s2 epoch=2\n120.000 INFO x: stopped\n"
    assert leading_intervals(s2) == [(2, 103.1, 120.0)]  # led until its log ends
    r = Result("split")
    r.led({"s1": [S1], "s2": [s2]})
    assert r.leaders == 1 and not r.broken


def test_two_schedulers_whose_leading_intervals_overlap_by_their_logs_break_the_run():
    s2 = "101.900 INFO llmgw-scheduler: leading name=s2 epoch=2\n"
    r = Result("split")
    r.led({"s1": [S1], "s2": [s2]})
    assert r.leaders == 2 and "s1 (epoch 1) led until 102.000, s2 (epoch 2)" in r.broken[0]


def test_two_leader_answers_count_as_an_overlap_only_if_close_enough_to_be_one_moment():
    watch = LeaderWatch(lambda s: "standby", [], every_s=3600, margin_s=1.0)
    watch.stop()
    watch.count({"s1": ("leader", 10.0, 10.1), "s2": ("leader", 10.0, 11.2)})  # 1.2 s apart
    assert (watch.most, watch.unsure) == (0, 1)
    watch.count({"s1": ("leader", 20.0, 20.1), "s2": ("leader", 20.0, 20.3)})
    assert watch.most == 2 and watch.overlaps == [["s1", "s2"]]
