"""The invariant counts of a partition table, from logs and what clients saw (pure)."""

from tests.chaos.traffic import CUT, FAILED, OK, Sent

from .report import Result, table


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
