"""Background work holds its store connections: an idle router, scheduler and agent on a
real PostgreSQL open (almost) no new database sessions, and a router under load opens no
more than an idle one.

Each new session is a backend forked on the server. Before the tools kept their
connections, an idle router opened about ten a second (213 in 20 s) because its lease
thread wrapped every 0.1 s tick in a fresh connection.
"""

import threading
import time
from collections import defaultdict

import psycopg2
import pytest
import requests

from tests.conftest import POSTGRES
from tests.helpers import eventually, llmgw
from tests.system.conftest import GiB

pytestmark = pytest.mark.postgres

# The bound: at most this many new sessions in a 20 s window, per tool.
BOUND = 4
WINDOW_S = 20.0


class Sessions:
    """The sessions opened on one database: exactly, from `pg_stat_database.sessions`,
    and by whom, from `pg_stat_activity` (its application_name is `tool:pid`) sampled
    every few milliseconds: a session shorter than that may go unattributed, never
    uncounted. Watched from the server's admin database, so watching adds none."""

    def __init__(self, url: str):
        self.name = url.rsplit("/", 1)[1]
        self._conn = psycopg2.connect(POSTGRES)
        self._conn.autocommit = True
        self._seen: dict[str, set] = defaultdict(set)  # tool -> {(pid, backend_start)}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def total(self) -> int:
        with self._lock, self._conn.cursor() as cur:
            cur.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", (self.name,))
            return int(cur.fetchone()[0])

    def held(self, tool: str) -> int:
        """Sessions a tool holds open now."""
        with self._lock, self._conn.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND application_name LIKE %s",
                (self.name, tool + ":%"),
            )
            return int(cur.fetchone()[0])

    def seen(self) -> dict[str, set]:
        with self._lock:
            return {tool: set(s) for tool, s in self._seen.items()}

    def _sample(self) -> None:
        conn = psycopg2.connect(POSTGRES)
        conn.autocommit = True
        with conn.cursor() as cur:
            while not self._stop.wait(0.005):
                cur.execute(
                    "SELECT application_name, pid, backend_start FROM pg_stat_activity"
                    " WHERE datname = %s",
                    (self.name,),
                )
                rows = cur.fetchall()
                with self._lock:
                    for app, pid, start in rows:
                        if app:  # not the server's own (autovacuum), which sessions omits
                            self._seen[app.split(":", 1)[0]].add((pid, start))
        conn.close()

    def watch(self, seconds: float, bound: int, what: str) -> dict:
        """Count the sessions opened in the next `seconds`; fail as soon as there are more
        than `bound`. -> {"total": n, tool: sessions seen opening}."""
        before_total, before = self.total(), self.seen()
        deadline = time.monotonic() + seconds
        while True:
            opened = self.total() - before_total
            by_tool = {
                tool: len(s - before.get(tool, set()))
                for tool, s in self.seen().items()
                if s - before.get(tool, set())
            }
            assert opened <= bound, (
                f"{what}: {opened} new sessions in {seconds - (deadline - time.monotonic()):.1f}s"
                f" (at most {bound} in {seconds:g}s); seen opening: {by_tool}"
            )
            if time.monotonic() >= deadline:
                return {"total": opened, **by_tool}
            time.sleep(0.2)

    def quiet_for(self, seconds: float) -> bool:
        """True once no session has opened for `seconds` (a condition for eventually)."""
        start = self.total()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.total() != start:
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()


@pytest.fixture
def idle(pg_store, cluster, api_key):
    """A scheduler, an agent and a router on one PostgreSQL store, serving model m,
    with a requests-per-minute limit on the key (so the router leases allowance)."""
    llmgw("limits", "set", "--key", api_key[0], "--rpm", "1000000", "--store")
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="model m to be served")
    sessions = Sessions(pg_store)
    # Settled: the requests above have gone idle (the lease thread gives its allowance
    # back after 5 s without use), and the store has seen no new session for 3 s.
    eventually(lambda: sessions.quiet_for(3.0), timeout=30, what="the store to go quiet")
    yield cluster, sessions
    sessions.close()


def test_an_idle_router_scheduler_and_agent_open_almost_no_store_sessions(idle):
    cluster, sessions = idle
    seen = sessions.watch(WINDOW_S, BOUND, "an idle router, scheduler and agent")
    print(f"\nsessions opened in {WINDOW_S:g}s, idle: {seen}")
    # Still working while we watched, not stuck: the router serves and sees the key.
    assert cluster.serves("m")


def test_a_router_under_load_opens_no_more_sessions_than_an_idle_one(idle):
    cluster, sessions = idle
    held_before = sessions.held("llmgw-router")
    answered, stop = [], threading.Event()

    def client():
        s = requests.Session()
        while not stop.is_set():
            r = s.post(
                f"{cluster.router_url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {cluster.secret}"},
                timeout=10,
            )
            answered.append(r.status_code)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        # Long enough for every periodic worker (usage flushes each second, leases tick
        # every 0.1 s) to have run many times under load.
        seen = sessions.watch(10.0, BOUND, "a router under load")
    finally:
        stop.set()
        for t in threads:
            t.join()
    print(f"\nsessions opened in 10s under load ({len(answered)} requests): {seen}")
    assert len(answered) >= 300 and set(answered) == {200}
    # Every row reached the store on the connections the router already holds or opened
    # once for this load: a handful, however many requests.
    assert sessions.held("llmgw-router") <= held_before + 2
