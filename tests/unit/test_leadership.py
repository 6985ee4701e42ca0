"""What a scheduler that steps down says about when it stopped acting."""

import logging
import time
from types import SimpleNamespace

import peewee

from llmgw_scheduler.leadership import Leadership

TIMINGS = SimpleNamespace(lease_s=3.0, renew_s=0.5, step_down_s=2.0, standby_retry_s=0.3)


def test_a_leader_that_hears_late_its_lease_ran_out_says_when_it_stopped_acting(caplog):
    """Its renewal hung on a store that stopped answering: it stopped acting when its
    lease ran out by its own clock, and says how long before the log line that was."""
    lead = Leadership(peewee.SqliteDatabase(":memory:"), SimpleNamespace(scheduler=TIMINGS),
                      "s1", "http://s1")  # fmt: skip
    lead.epoch, lead._valid_until = 4, time.monotonic() - 5.0
    assert not lead.leading()
    with caplog.at_level(logging.WARNING):
        lead.lose("no renewal for 2s")
    (line,) = [r.getMessage() for r in caplog.records if "stepped_down" in r.getMessage()]
    ago = float(line.split("stopped_s_ago=")[1])
    assert line.startswith("stepped_down epoch=4 ") and 5.0 <= ago < 6.0, line


def test_a_leader_told_of_a_newer_epoch_stops_at_once_and_says_so(caplog):
    lead = Leadership(peewee.SqliteDatabase(":memory:"), SimpleNamespace(scheduler=TIMINGS),
                      "s1", "http://s1")  # fmt: skip
    lead.epoch, lead._valid_until = 4, time.monotonic() + 1.5
    with caplog.at_level(logging.WARNING):
        lead.lose("an agent has seen epoch 5")
    assert "stopped_s_ago=0.0" in caplog.text and not lead.leading()
