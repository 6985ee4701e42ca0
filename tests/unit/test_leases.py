"""Leasing allowance from the store, on SQLite and a real PostgreSQL: the statements
never give the fleet more than the limit, however many lease at once."""

import threading

import pytest

from llmgw.store import migrate, open_store
from llmgw.store.tenancy import LimitWindow
from llmgw_router import leases
from llmgw_router.leases import Leaser
from llmgw_router.limits import Limiter, Reservation
from tests.helpers import eventually

T0 = 1_800_000_000.0


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def in_threads(db, n, fn):
    errors = []

    def run(i):
        try:
            with db.connection_context():
                fn(i)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_many_leasing_at_once_get_exactly_the_limit_and_never_more(db):
    got = [0] * 12

    def lease_until_refused(i):
        while True:
            granted, total = leases.lease(db, "rpm:key:k", 60, 120.0, 7, 500)
            assert total <= 500
            if granted == 0:
                return
            got[i] += granted

    in_threads(db, len(got), lease_until_refused)
    assert sum(got) == 500
    row = LimitWindow.get(LimitWindow.counter == "rpm:key:k", LimitWindow.window == 60)
    assert row.leased == 500


def test_what_is_given_back_can_be_leased_again_and_a_lowered_limit_grants_nothing(db):
    assert leases.lease(db, "c", 60, 120.0, 10, 10) == (10, 10)
    leases.give_back(db, "c", 60, 4)
    assert leases.lease(db, "c", 60, 120.0, 10, 10) == (4, 10)
    assert leases.lease(db, "c", 60, 120.0, 1, 8) == (0, 10)
    assert leases.lease(db, "c", 120, 180.0, 3, 10) == (3, 3), "a new window starts at zero"


def test_concurrency_holds_never_add_up_past_the_limit_and_expired_ones_free_their_slots(db):
    held = {}

    def grab(i):
        for _ in range(5):
            held[i], total = leases.hold(db, "conc:key:k", f"r{i}", 3, 8, T0, 30)
            assert total <= 8

    in_threads(db, 6, grab)
    assert sum(held.values()) <= 8
    # A router that vanished: once its hold expires, others may have its slots.
    assert leases.hold(db, "conc:key:k", "late", 8, 8, T0 + 31, 30) == (8, 8)


def test_the_lease_thread_tops_a_counter_up_ahead_of_need_and_returns_it_when_idle(db):
    lim = Limiter()
    leaser = Leaser(lim, db)
    c = lim.counter("rpm", "user", "ada", 1000)
    short = lim.reserve([(c, 1)], T0)
    lim.add_waiter(c, object(), 1)  # a request waiting for its first lease
    leaser.tick(T0)
    assert c.local >= 1 and not c.waiters and short.wait
    used = 0
    for i in range(1, 6):  # steady use: it keeps some allowance in hand, a tenth at most
        for _ in range(20):
            used += isinstance(lim.reserve([(c, 1)], T0 + i * 0.1), Reservation)
        leaser.tick(T0 + i * 0.1)
    assert used > 60 and 0 < c.local <= 100
    assert LimitWindow.get(LimitWindow.counter == c.name).leased == used + c.local
    leaser.tick(T0 + 10)  # idle: what is left goes back for other routers
    assert c.local == 0
    assert LimitWindow.get(LimitWindow.counter == c.name).leased == used


def test_a_router_that_stops_gives_back_its_allowance_and_slots(db):
    lim = Limiter()
    leaser = Leaser(lim, db)
    c = lim.counter("tokens/day", "org", "acme", 10_000)
    conc = lim.counter("concurrent", "org", "acme", 4)
    for counter in (c, conc):
        lim.add_waiter(counter, object(), 500 if counter is c else 1)
    leaser.tick(T0)
    assert c.local >= 500 and conc.local >= 1
    leaser.stop()
    assert LimitWindow.get(LimitWindow.counter == c.name).leased == 0
    assert leases.hold(db, conc.name, "other", 4, 4, T0, 30) == (4, 4)


def test_the_lease_worker_touches_no_store_until_a_limit_is_in_use_then_keeps_one_connection(db):
    db.close()
    opened = []
    connect = db._connect
    db._connect = lambda: opened.append(1) or connect()
    lim = Limiter()
    leaser = Leaser(lim, db, tick_s=0.005)
    ticks = []
    tick = leaser.tick
    leaser.tick = lambda now: ticks.append(now) or tick(now)
    leaser.start(loop=None)
    try:
        eventually(lambda: len(ticks) >= 20, 5, what="twenty idle ticks")
        assert opened == []  # no counters: not even a connection
        c = lim.counter("rpm", "key", "k", 1000)
        lim.add_waiter(c, object(), 1)
        leaser.wake()
        eventually(lambda: opened, 5, what="the first lease")
        n = len(ticks)
        eventually(lambda: len(ticks) >= n + 20, 5, what="twenty more ticks")
    finally:
        leaser.stop()
    assert len(opened) == 1  # leased, gave back when idle, and stopped on one connection
    assert LimitWindow.get(LimitWindow.counter == c.name).leased == 0
