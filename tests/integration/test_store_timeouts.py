"""A PostgreSQL store that stops answering (a partition that drops packets, a frozen
host) fails a tool's call within store.timeout_s instead of holding its thread for
minutes; the real server, behind tests/blackhole.py."""

import threading
import time

import peewee
import psycopg2
import pytest

from llmgw.config import Config
from llmgw.store import database_for, drop_connection, open_store, timeouts
from llmgw_scheduler.leadership import store_timeout
from tests.blackhole import Blackhole

T = 1.5  # store.timeout_s for these tests


@pytest.fixture
def hole(pg_store):
    """(proxy, URL through it) in front of a fresh database."""
    proxy, url = Blackhole.for_url(pg_store)
    yield proxy, url
    proxy.heal()
    drop_connection()
    proxy.close()


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except peewee.PeeweeException as e:
        return time.monotonic() - t0, e
    return time.monotonic() - t0, None


def test_a_query_to_a_store_that_stopped_answering_fails_within_the_timeout(hole):
    proxy, url = hole
    db = open_store(url, timeout_s=T, bounded=True)
    assert db.execute_sql("SELECT 1").fetchone() == (1,)
    proxy.blackhole()
    took, err = timed(lambda: db.execute_sql("SELECT 2"))
    assert isinstance(err, peewee.OperationalError), err
    assert "did not answer within 1.5s (store.timeout_s)" in str(err)
    assert T <= took < T + 1.0
    # A fresh connection while it still does not answer: bounded too.
    drop_connection(db)
    took, err = timed(lambda: db.execute_sql("SELECT 3"))
    assert isinstance(err, peewee.OperationalError) and took < T + 1.0
    drop_connection(db)
    proxy.heal()
    assert db.execute_sql("SELECT 4").fetchone() == (4,)


def test_opening_a_store_that_does_not_answer_fails_within_the_timeout(hole):
    proxy, url = hole
    proxy.blackhole()
    t0 = time.monotonic()
    with pytest.raises(Exception, match="cannot open store .*did not answer within 1.5s"):
        open_store(url, timeout_s=T, bounded=True)
    assert time.monotonic() - t0 < T + 1.0


def test_without_the_bound_a_query_waits_for_as_long_as_the_store_is_silent(hole):
    """What a tool did before (and what `llmgw` commands still do): it waits."""
    proxy, url = hole
    db = open_store(url, timeout_s=T)
    db.execute_sql("SELECT 1")
    proxy.blackhole()
    done = threading.Event()

    def query():
        db.execute_sql("SELECT 2")
        done.set()

    threading.Thread(target=query, daemon=True).start()
    assert not done.wait(T + 1.0)  # past the bound, still waiting
    proxy.heal()
    assert done.wait(5)  # and it is answered once the store is back


def test_a_client_cut_off_inside_a_transaction_does_not_hold_its_row_locks(hole, pg_store):
    """The lease's row: a leader cut off between its UPDATE and its COMMIT must not
    keep the standby from taking the lease until the server's keepalive (2 hours)."""
    proxy, url = hole
    db = open_store(url, timeout_s=T, bounded=True)
    db.execute_sql("CREATE TABLE held (id INT PRIMARY KEY, v INT)")
    db.execute_sql("INSERT INTO held VALUES (1, 0)")
    db.execute_sql("BEGIN")
    db.execute_sql("UPDATE held SET v = 1 WHERE id = 1")
    proxy.blackhole()
    other = psycopg2.connect(pg_store)
    other.autocommit = True
    try:
        t0 = time.monotonic()
        with other.cursor() as cur:
            cur.execute("SET lock_timeout = '20s'")
            cur.execute("UPDATE held SET v = 2 WHERE id = 1")
            took = time.monotonic() - t0
            cur.execute("SELECT v FROM held WHERE id = 1")
            assert cur.fetchone() == (2,)  # the cut-off client's update was rolled back
    finally:
        other.close()
    assert took < T + 2.0, f"the row stayed locked {took:.1f}s"


def test_a_slow_statement_is_stopped_after_the_timeout_but_a_patient_one_runs_on(hole):
    _, url = hole
    db = open_store(url, timeout_s=T, bounded=True)
    took, err = timed(lambda: db.execute_sql("SELECT pg_sleep(3)"))
    assert err is not None and took < T + 1.0
    drop_connection(db)
    with timeouts.patient(db):
        assert db.execute_sql("SELECT pg_sleep(2), 'done'").fetchone() == ("", "done")
    # Bounded again afterwards, on the server's side too.
    assert db.execute_sql("SHOW statement_timeout").fetchone() == ("1500ms",)
    took, err = timed(lambda: db.execute_sql("SELECT pg_sleep(3)"))
    assert err is not None


def test_every_tool_connects_with_keepalives_and_a_user_timeout_from_the_setting():
    db = database_for("postgresql://db.example/llmgw", timeout_s=10)
    p = db.connect_params
    assert p["connect_timeout"] == 10 and p["tcp_user_timeout"] == 10_000
    assert p["keepalives"] == 1 and p["keepalives_idle"] + 3 * p["keepalives_interval"] <= 10
    assert "options" not in p  # `llmgw` commands: long reports may run as long as they take


def test_a_scheduler_waits_on_the_store_less_than_its_lease_needs():
    cfg = Config()
    assert store_timeout(cfg) == 5.0  # step_down_s 10 - renew_s 5, below timeout_s 10
    cfg.store.timeout_s = 3.0
    assert store_timeout(cfg) == 3.0
    cfg.scheduler.renew_s, cfg.scheduler.step_down_s = 0.5, 2.0
    assert store_timeout(cfg) == 1.5


def test_a_store_timeout_of_zero_is_refused_with_the_setting_named(pg_store):
    with pytest.raises(Exception, match=r"store.timeout_s \(0\) must be above 0"):
        open_store(pg_store, timeout_s=0)
