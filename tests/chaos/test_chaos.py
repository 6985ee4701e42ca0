"""Kill -9, one after another, an engine, an agent, the leading scheduler and a router,
under steady mixed traffic through two routers, and check after each what must hold:

- every request that had not started streaming was answered (retried on another replica
  by the router, or on the other router by the client, as a load balancer would);
- replicas are adopted, not doubled: no start but the dead engine's replacement, the
  same engine processes after an agent restart, the same replicas after a takeover;
- no replica id was ever started twice (counted in every scheduler's and agent's log);
- each complete 200 answer the clients saw has exactly one usage row with status 200,
  and no other request has one.

The table of what was killed and what the clients saw is printed in pytest's summary
and written to chaos.md in the test's directory.
"""

import os
import re
import signal
import time

import psycopg2
import pytest

from tests.helpers import eventually

from .fleet import NODE_MEMORY, ready, role
from .report import TABLES, Phase, table
from .traffic import CUT, FAILED, OK, Traffic

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.timeout(300)]

SCHEDULER_STARTS = re.compile(r": start_replica replica=(\S+)")
AGENT_STARTS = re.compile(r": shard_process_started shard=(\S+)")


def test_an_engine_an_agent_the_leader_and_a_router_killed_under_load_lose_no_request_and_no_usage_row(  # noqa: E501
    fleet, pg_store, tmp_path, request
):
    c = fleet
    traffic = Traffic([c.router_urls["r1"], c.router_urls["r2"]], c.secret, "m")
    phases: dict[str, Phase] = {}
    starts_at: dict[str, int] = {}
    broken: list[str] = []  # every invariant that did not hold, said in words

    def starts() -> list[str]:
        return SCHEDULER_STARTS.findall(c.logs("scheduler*.log"))

    def steady(name: str, more: int) -> None:
        n = traffic.answered(name) + more
        eventually(lambda: traffic.answered(name) >= n, timeout=30, what=f"{n} answers in {name}")

    def phase(name: str, killed: str, kill=None, recover=None) -> None:
        traffic.phase = name
        phases[name] = Phase(killed)
        starts_at[name] = len(starts())
        steady(name, 10)
        if kill is not None:
            t0 = time.monotonic()
            kill()
            recover()
            phases[name].recovered_s = time.monotonic() - t0
        steady(name, 20)  # and the fleet goes on answering

    try:
        phase("steady", "nothing")

        # An engine: the router retries its requests on the other replica; the scheduler
        # starts a replacement, which is the one start the whole run may see.
        engine = c.shards("node-a")[0]

        def engine_replaced():
            eventually(
                lambda: [
                    r["id"]
                    for r in c.admin("/v1/replicas", scheduler="s1")
                    if r["node"] == "node-a" and r["state"] == "ready" and r["id"] != engine["id"]
                ],
                timeout=40,
                what="a replacement engine on node-a",
            )
            eventually(lambda: ready(c, "s1") == 2, timeout=20, what="two ready replicas")
            c.slow_engines()

        phase(
            "engine",
            f"engine of node-a (replica {engine['id']})",
            lambda: os.killpg(engine["pid"], signal.SIGKILL),
            engine_replaced,
        )

        # The agent: its engines outlive it and its next start adopts them.
        engines = c.engine_pids()

        def agent_back():
            c.start_agent("node-a", memory=NODE_MEMORY)
            eventually(
                lambda: ": shard_adopted " in c.agents["node-a"].log(),
                timeout=20,
                what="node-a's agent to adopt its engine",
            )
            eventually(lambda: ready(c, "s1") == 2, timeout=20, what="two ready replicas")
            if c.engine_pids() != engines:
                broken.append(f"agent: engines were {engines}, are {c.engine_pids()}")

        phase("agent", "agent of node-a", lambda: c.agents["node-a"].stop(signal.SIGKILL),
              agent_back)  # fmt: skip

        # The leader: the standby takes the lease and adopts the running replicas; the
        # killed one comes back as the standby.
        replicas = {r["id"] for r in c.admin("/v1/replicas", scheduler="s1")}

        def standby_leads():
            eventually(lambda: role(c, "s2") == "leader", timeout=20, what="s2 to lead")
            eventually(lambda: ready(c, "s2") == 2, timeout=20, what="s2 to see two replicas")
            adopted = {r["id"] for r in c.admin("/v1/replicas", scheduler="s2")}
            if adopted != replicas:
                broken.append(f"scheduler: replicas were {replicas}, s2 has {adopted}")
            if c.engine_pids() != engines:
                broken.append(f"scheduler: engines were {engines}, are {c.engine_pids()}")
            c.start_scheduler("s1")
            eventually(lambda: role(c, "s1") == "standby", timeout=20, what="s1 to stand by")

        phase("scheduler", "leading scheduler s1 (standby s2 on PostgreSQL)",
              lambda: c.schedulers["s1"].stop(signal.SIGKILL), standby_leads)  # fmt: skip

        # A router: clients fail over to the other one until it is started again.
        def router_back():
            c.start_named_router("r1")
            n = traffic.answered("router", router=0) + 5
            eventually(lambda: traffic.answered("router", router=0) >= n, timeout=20,
                       what="r1 to answer again")  # fmt: skip

        phase("router", "router r1", lambda: c.routers["r1"].stop(signal.SIGKILL), router_back)
    finally:
        traffic.stop()
    starts_at["end"] = len(starts())

    # Stopped as systemd stops them: each flushes its usage rows first.
    for r in c.routers.values():
        r.stop()
    conn = psycopg2.connect(pg_store)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT request_id FROM usage WHERE status = 200")
            rows200 = [rid for (rid,) in cur.fetchall()]
    finally:
        conn.close()

    # -- the invariants, phase by phase --------------------------------------------------
    names = list(phases)
    per_rid: dict[str, int] = {}
    for rid in rows200:
        per_rid[rid] = per_rid.get(rid, 0) + 1
    for i, name in enumerate(names):
        p, sent = phases[name], traffic.of(name)
        p.sent = len(sent)
        p.answered = sum(s.outcome == OK for s in sent)
        p.cut = sum(s.outcome == CUT for s in sent)
        p.failed = sum(s.outcome == FAILED for s in sent)
        p.slowest_s = max((s.took_s for s in sent if s.outcome == OK), default=0.0)
        p.failed_over = sum(s.outcome == OK and len(s.routers) == 2 for s in sent)
        p.started = starts_at[names[i + 1] if i + 1 < len(names) else "end"] - starts_at[name]
        ok = {s.rid for s in sent if s.outcome == OK}
        mine = {s.rid for s in sent}
        p.rows = sum(n for rid, n in per_rid.items() if rid in mine)
        p.missing = sum(1 for rid in ok if rid not in per_rid)
        p.twice = sum(1 for rid in ok if per_rid.get(rid, 0) > 1)
        p.unseen = sum(1 for rid in mine - ok if rid in per_rid)
        p.failures = [f"{s.rid}: {s.detail}" for s in sent if s.outcome == FAILED]
        if p.failed:
            broken.append(f"{name}: {p.failed} requests not answered, e.g. {p.failures[:3]}")
        want = 1 if name == "engine" else 0
        if p.started != want:
            broken.append(f"{name}: {p.started} replicas started, expected {want}")
        if p.missing or p.twice or p.unseen:
            broken.append(f"{name}: usage rows missing {p.missing}, twice {p.twice},"
                          f" for answers not seen {p.unseen}")  # fmt: skip

    ids = starts()
    if len(ids) != len(set(ids)):
        broken.append(f"a replica was started twice by the schedulers: {ids}")
    spawned = AGENT_STARTS.findall(c.logs("agent-*.log"))
    if len(spawned) != len(set(spawned)) or set(spawned) != set(ids):
        broken.append(f"engine processes started {spawned}, replicas asked for {ids}")
    if len(c.engine_pids()) != 2:
        broken.append(f"{len(c.engine_pids())} engines run at the end, not 2")

    text = table(list(phases.values()))
    (tmp_path / "chaos.md").write_text(text + "\n\n" + "".join(f"- {b}\n" for b in broken))
    request.config.stash.setdefault(TABLES, []).append(text)
    print("\n" + text)
    assert not broken, "\n".join(broken)
