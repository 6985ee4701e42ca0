"""A tool cut off from PostgreSQL (tests/blackhole.py between it and the real server):
it stops relying on the store within [store] timeout_s, and is back once the store
answers, even where its old connections never answer again."""

import time

import psycopg2
import requests

from tests.blackhole import Blackhole
from tests.helpers import eventually
from tests.system.conftest import GiB
from tests.system.test_standby import role, status

LEADER = 'llmgw_control_plane_leader{scheduler="%s"}'


def test_a_leader_cut_off_from_the_store_stops_leading_and_stands_by_once_it_answers(
    cluster, pg_store, api_key
):
    hole, url = Blackhole.for_url(pg_store)
    try:
        cluster.add_scheduler("s2")
        cluster.add_model("m", memory=GiB)
        cluster.scheduler_env = {"LLMGW_STORE": url}  # s1 only: s2 reaches the store
        s1 = cluster.start_scheduler("s1")
        cluster.scheduler_env = {}
        eventually(lambda: role(cluster, "s1") == "leader", what="s1 to lead")
        cluster.start_scheduler("s2")
        cluster.start_agent("node-a", memory=3 * GiB)
        cluster.start_router(api_key[1])
        eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")
        epoch = status(cluster, "s1")["epoch"]

        hole.blackhole()
        t0 = time.monotonic()
        # lease 3 s and a standby's retry 0.3 s; s1's store calls give up after 1.5 s
        # (step_down_s 2 - renew_s 0.5), so it says it does not lead, not only stops.
        eventually(lambda: role(cluster, "s2") == "leader", timeout=15, what="s2 to lead")
        assert status(cluster, "s2")["epoch"] == epoch + 1
        eventually(
            lambda: cluster.metric(LEADER % "s1", scheduler="s1", default=None) == 0,
            timeout=6,
            what="s1's metric to say it does not lead",
        )
        said = time.monotonic() - t0
        eventually(lambda: "did not answer within 1.5s" in s1.log(), what="a bounded failure")
        assert ": lease_store_failed " in s1.log()
        # Cut off for several bounds; then the old connections stay dead for good.
        time.sleep(4)  # the partition lasting; nothing is asserted across it
        mark = len(s1.log())
        hole.heal(forget=True)
        t1 = time.monotonic()
        eventually(lambda: ": lease_store_recovered " in s1.log()[mark:], timeout=10,
                   what="s1's lease worker to reach the store again")  # fmt: skip
        back = time.monotonic() - t1
        eventually(lambda: "standing_by" in s1.log()[mark:], what="s1 to stand by")
        assert role(cluster, "s1") == "standby" and role(cluster, "s2") == "leader"
        assert status(cluster, "s1")["leader"]["name"] == "s2"
        assert cluster.serves("m")
        print(f"s1 said it does not lead {said:.1f}s into the cut; back {back:.1f}s after")
    finally:
        hole.heal()
        hole.close()


def usage_rows(url: str) -> list[str]:
    """The request ids of every usage row in the store, straight from PostgreSQL."""
    conn = psycopg2.connect(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT request_id FROM usage")
            return [r[0] for r in cur.fetchall()]
    finally:
        conn.close()


def health(cluster) -> dict:
    return requests.get(f"{cluster.router_url}/health", timeout=5).json()


def ask(cluster, rid: str) -> int:
    r = requests.post(
        f"{cluster.router_url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {cluster.secret}", "x-request-id": rid},
        timeout=5,
    )
    return r.status_code


def test_a_router_cut_off_from_the_store_spools_usage_and_writes_each_row_once_after(
    cluster, pg_store, api_key
):
    hole, url = Blackhole.for_url(pg_store)
    try:
        cluster.add_model("m", memory=GiB)
        cluster.start_scheduler()
        cluster.start_agent("node-a", memory=2 * GiB)
        cluster.router_env = {"LLMGW_STORE": url}
        cluster.router_extra = "[store]\ntimeout_s = 2.0\n"
        cluster.start_router(api_key[1])
        eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")
        # The probes above were answered and billed too: count from here.
        eventually(lambda: health(cluster)["usage_rows_pending"] == 0, what="a quiet writer")
        before = len(usage_rows(pg_store))
        sent = [f"before-{i}" for i in range(5)]
        assert [ask(cluster, rid) for rid in sent] == [200] * 5
        eventually(lambda: set(sent) <= set(usage_rows(pg_store)), what="rows in the store")

        hole.blackhole()
        during = [f"during-{i}" for i in range(20)]
        t0 = time.monotonic()
        assert [ask(cluster, rid) for rid in during] == [200] * 20  # never waits on it
        assert time.monotonic() - t0 < 10
        eventually(lambda: health(cluster)["usage_rows_pending"] == 20, what="rows spooled")
        spool = cluster.tmp / "router-state" / "usage-spool"
        assert any(p.stat().st_size for p in spool.glob("usage-*.spool"))
        log = cluster.router.log
        failed = eventually(
            lambda: [x for x in log().splitlines() if ": usage_write_failed " in x],
            timeout=8,
            what="the writer to give up on the store",
        )
        assert "did not answer within 2s" in failed[0]
        assert not set(during) & set(usage_rows(pg_store))

        hole.heal(forget=True)  # its old connections never answer again
        eventually(lambda: health(cluster)["usage_rows_pending"] == 0, timeout=40,
                   what="the spool to be written")  # fmt: skip
        rows = usage_rows(pg_store)
        for rid in sent + during:
            assert rows.count(rid) == 1, f"{rid}: {rows.count(rid)} rows"
        assert len(rows) == before + len(sent) + len(during)
        eventually(lambda: ": usage_write_recovered " in log(), what="the writer to recover")
    finally:
        hole.heal()
        hole.close()
