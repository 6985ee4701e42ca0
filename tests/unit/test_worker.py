"""The shared background worker: ticks, backs off, logs once each way, keeps one
connection, and runs its stop hook on its own thread."""

import logging
import os
import threading

import peewee

from llmgw.worker import Worker
from tests.helpers import eventually


def test_a_failing_tick_is_logged_once_and_its_recovery_once(caplog):
    outcomes = iter([ValueError("store down"), ValueError("store down"), None, None])

    def tick():
        e = next(outcomes)
        if e:
            raise e

    w = Worker("probe", tick, 0.01)
    caplog.set_level(logging.INFO)
    waits = [w.run_once() for _ in range(4)]
    failed = [r for r in caplog.records if "probe_failed" in r.getMessage()]
    recovered = [r for r in caplog.records if "probe_recovered" in r.getMessage()]
    assert len(failed) == 1 and "store down" in failed[0].getMessage()
    assert len(recovered) == 1 and "after_failures=2" in recovered[0].getMessage()
    # Backs off: the second failure waits about twice the first (jitter is ±20%).
    assert waits[1] > waits[0] * 1.3
    assert waits[2] == waits[3] == 0.01
    assert not w.failing


def test_backoff_is_capped():
    w = Worker("x", lambda: 1 / 0, 1.0, backoff_max_s=4.0)
    waits = [w.run_once() for _ in range(10)]
    assert max(waits) <= 4.0 * 1.2
    assert w.failures == 10


def test_the_tick_chooses_its_next_wait_and_wake_cuts_it_short():
    ticks = []
    w = Worker("w", lambda: ticks.append(1) or 3600.0, 0.01)
    w.start()
    eventually(lambda: len(ticks) == 1, 5, what="the first tick")
    w.wake()
    eventually(lambda: len(ticks) == 2, 5, what="a woken tick")
    w.stop()
    assert not w._thread.is_alive()


def test_a_worker_keeps_one_connection_and_drops_it_after_a_failure(tmp_path):
    class Counting(peewee.SqliteDatabase):
        connects = 0

        def _connect(self):
            Counting.connects += 1
            return super()._connect()

    db = Counting(str(tmp_path / "w.db"))
    seen = []
    fail = threading.Event()

    def tick():
        db.execute_sql("select 1")
        seen.append(Counting.connects)
        if fail.is_set():
            fail.clear()
            raise peewee.OperationalError("server closed the connection")

    stopped = []
    w = Worker("db", tick, 0.0, db=db, on_stop=lambda: stopped.append(db.is_closed()))
    w.start()
    eventually(lambda: len(seen) >= 5, 5, what="five ticks")
    assert seen[:5] == [1] * 5  # one connection across ticks
    n = len(seen)
    fail.set()
    eventually(lambda: len(seen) >= n + 5, 5, what="ticks after the failure")
    w.stop()
    assert set(seen) == {1, 2}  # reconnected once, after the failure
    assert stopped == [False]  # on_stop had the connection


def test_what_a_failing_worker_does_meanwhile_is_said_with_its_failure(caplog):
    w = Worker("lease", lambda: 1 / 0, 0.01, failed_fields={"action": "admitting what is held"})
    caplog.set_level(logging.INFO)
    w.run_once()
    w.run_once()
    failed = [r.getMessage() for r in caplog.records if "lease_failed" in r.getMessage()]
    assert len(failed) == 1 and "action=" in failed[0] and "admitting what is held" in failed[0]


def test_a_worker_given_a_nice_value_runs_its_ticks_at_that_priority():
    """The router's usage writer yields the core to requests this way (a nice value is
    per thread on Linux: the rest of the process keeps its own)."""
    seen = []

    def tick():
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return 3600.0

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    w = Worker("low", tick, 0.01, nice=7)
    w.start()
    eventually(lambda: seen, 5, what="a tick")
    w.stop()
    assert seen == [max(7, mine)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
