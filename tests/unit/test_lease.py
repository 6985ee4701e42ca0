"""The leader lease on both stores, timed by the database's clock."""

import threading
import time

from llmgw import lease
from llmgw.store import migrate, open_store


def store(url):
    db = open_store(url)
    migrate(db)
    return db


def test_the_first_scheduler_takes_the_lease_and_a_second_cannot_while_it_lasts(store_url):
    db = store(store_url)
    assert lease.acquire(db, "a/1", "a", "http://a", 30.0) == 1
    assert lease.acquire(db, "b/1", "b", "http://b", 30.0) is None
    held = lease.current(db)
    assert (held.holder, held.name, held.admin_url, held.epoch) == ("a/1", "a", "http://a", 1)
    assert 25.0 < held.expires_in <= 30.0


def test_an_expired_lease_passes_on_with_the_epoch_one_higher_and_the_old_holder_cannot_renew(
    store_url,
):
    db = store(store_url)
    assert lease.acquire(db, "a/1", "a", "", 0.3) == 1
    assert lease.renew(db, "a/1", 1, 0.3)
    deadline = time.monotonic() + 10
    while (epoch := lease.acquire(db, "b/1", "b", "", 30.0)) is None:
        assert time.monotonic() < deadline, "the lease never expired"
    assert epoch == 2
    assert not lease.renew(db, "a/1", 1, 30.0)  # fenced: it must step down
    assert lease.renew(db, "b/1", 2, 30.0)


def test_a_renewal_after_expiry_fails_even_if_nobody_took_over(store_url):
    db = store(store_url)
    assert lease.acquire(db, "a/1", "a", "", 0.2) == 1
    deadline = time.monotonic() + 10
    while lease.current(db).expires_in > 0:
        assert time.monotonic() < deadline
    assert not lease.renew(db, "a/1", 1, 30.0)


def test_the_epoch_never_goes_back_release_and_force(store_url):
    db = store(store_url)
    assert lease.acquire(db, "a/1", "a", "", 30.0) == 1
    assert lease.release(db, "a/1", 1)
    assert lease.acquire(db, "a/2", "a", "", 30.0) == 2  # released: free at once
    assert lease.acquire(db, "a/3", "a", "", 30.0, force=True) == 3
    assert not lease.release(db, "a/2", 2)  # not its lease any more


def test_concurrent_standbys_never_both_take_the_lease(store_url):
    db = store(store_url)
    won: list[tuple[str, int]] = []
    start = threading.Barrier(6)

    def standby(i):
        start.wait()
        with db.connection_context():
            epoch = lease.acquire(db, f"s{i}", f"s{i}", "", 30.0)
        if epoch is not None:
            won.append((f"s{i}", epoch))

    threads = [threading.Thread(target=standby, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and won[0][1] == 1
    assert lease.current(db).holder == won[0][0]


def test_schedulers_say_what_they_do(store_url):
    db = store(store_url)
    lease.seen(db, "a", "a/1", "leader", "http://a")
    lease.seen(db, "b", "b/1", "standby", "http://b")
    lease.seen(db, "a", "a/1", "leader", "http://a")
    rows = lease.schedulers(db)
    assert [(r["name"], r["role"]) for r in rows] == [("a", "leader"), ("b", "standby")]
    assert all(0 <= r["seen_s_ago"] < 5 for r in rows)
