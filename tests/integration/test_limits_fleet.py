"""Two real routers on one store (a real PostgreSQL, and SQLite) share one key's limits:
together they never admit more than the limit (docs/limits.md states the bounds)."""

import json
import threading
import time

import pytest

from tests.helpers import eventually, llmgw, start_router
from tests.integration.conftest import CHAT, ENGINE_KEY, Client, ctl

# The lease thread holds at most a tenth of a limit unused (leases.CAP_SHARE).
CAP_SHARE = 10


def reservation(body: dict) -> int:
    """What a request reserves from a token budget: the body's bytes + max_tokens."""
    return len(json.dumps(body)) + body["max_tokens"]


@pytest.fixture
def two_routers(store_url, tmp_path, engine):
    (tmp_path / "engine.key").write_text(ENGINE_KEY + "\n")
    started = []

    def make(secret):
        for _ in range(2):
            proc, url = start_router(
                tmp_path,
                '[router]\nlisten = "127.0.0.1:{port}"\nlimits_refresh_s = 0.2\n'
                "lease_wait_s = 3.0\n"
                f'[[router.endpoints]]\nid = "e0"\nurl = "{engine.url}"\nmodels = ["m"]\n'
                f'key = "@{tmp_path / "engine.key"}"\n',
            )
            started.append(proc)
        return [Client(f"http://127.0.0.1:{p.health.split(':')[2].split('/')[0]}", secret)
                for p in started]  # fmt: skip

    yield make
    for proc in started:
        proc.stop()


def hammer(clients, threads_each: int, seconds: float) -> list[int]:
    statuses = []
    stop = time.monotonic() + seconds

    def run(client):
        while time.monotonic() < stop:
            statuses.append(client.chat().status_code)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients
               for _ in range(threads_each)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_two_routers_hammering_one_key_admit_at_most_its_rpm_in_a_minute(two_routers):
    limit = 40
    key = ctl("keys", "create", "--name", "shared")
    llmgw("limits", "set", "--key", key["id"], "--rpm", str(limit), "--store")
    clients = two_routers(key["secret"])
    left = 60 - time.time() % 60
    if left < 12:  # all of it inside one clock minute: limits count in fixed minutes
        time.sleep(left + 0.1)
    statuses = hammer(clients, threads_each=6, seconds=4.0)
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    assert statuses.count(429) > 0, "the hammering must go past the limit"
    # Never more than the limit; fewer only by what each router still held unused
    # when the hammering stopped.
    assert limit - 2 * (limit // CAP_SHARE) <= admitted <= limit


def test_two_routers_never_overspend_a_budget_taken_all_at_once(two_routers, engine):
    fits = 10
    budget = fits * reservation(CHAT)
    llmgw("orgs", "create", "acme", "--store")
    llmgw("users", "create", "ada", "--org", "acme", "--store")
    key = ctl("keys", "create", "--name", "ada", "--user", "ada")
    llmgw("budgets", "set", "--org", "acme", "--period", "day", "--tokens", str(budget), "--store")
    clients = two_routers(key["secret"])
    engine.control(first_delay_s=2.0)  # every request in flight at once
    statuses = []

    def ask(client):
        statuses.append(client.chat().status_code)

    threads = [threading.Thread(target=ask, args=(clients[i % 2],)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = statuses.count(200)
    # Each router can strand less than one request's reservation in a partial lease.
    assert fits - 2 <= admitted <= fits
    assert statuses.count(429) == 40 - admitted
    (row,) = ctl("budgets", "list")
    assert row["used"]["tokens"] <= budget
    used = eventually(
        lambda: [r for r in ctl("usage", "--by", "org") if r["requests"] == 40],
        what="all 40 usage rows, refused ones too",
    )
    assert used[0]["prompt_tokens"] + used[0]["completion_tokens"] <= budget


def test_two_routers_hold_no_more_concurrent_requests_than_the_limit(two_routers, engine):
    key = ctl("keys", "create", "--name", "shared")
    llmgw("limits", "set", "--key", key["id"], "--concurrent", "3", "--store")
    clients = two_routers(key["secret"])
    engine.control(first_delay_s=1.5)
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            most[0] = max(most[0], engine.stats()["active"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    statuses = hammer(clients, threads_each=4, seconds=3.0)
    stop.set()
    watcher.join()
    assert 1 <= most[0] <= 3
    assert statuses.count(200) >= 2 and statuses.count(429) > 0
