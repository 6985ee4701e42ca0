"""One scenario's run: steady mixed traffic through the routers behind a balancer that
probes /ready, a thread watching who leads, and at the end the invariants checked and
the table printed, written to partition.md in the test's directory and kept for pytest's
summary.

A scenario reads:

    hosts.add_model("m", min_=2, max_=2)
    hosts.start()                      # s1 leads, s2 stands by, a1-a3, r1 and r2
    sc = Scenario(hosts, request, "what was cut")
    try:
        sc.steady(10)
        hosts.net.cut("a1", "s1")      # the fault, and what must hold meanwhile
        ...
        hosts.net.heal("a1", "s1")
        sc.healed()
        sc.converged(lambda: ..., what="the catalog again")
    finally:
        result = sc.finish()
    assert not result.broken, "\n".join(result.broken)
"""

import os
import time

import psycopg2

from tests.chaos.traffic import Traffic
from tests.helpers import eventually

from .fleet import LEASE_S, STEP_DOWN_S, Fleet
from .report import TABLES, LeaderWatch, Result, table


class Scenario:
    def __init__(self, fleet: Fleet, request, fault: str, model: str = "m"):
        self.f, self.request = fleet, request
        self.result = Result(fault)
        self.traffic = Traffic(
            [fleet.router_url(r) for r in fleet.routers], fleet.secret, model,
            tag=request.node.name[:40], probe_s=0.5,
        )  # fmt: skip
        self.traffic.phase = "run"
        # Two leaders' answers closer than lease_s - step_down_s cannot both be true.
        self.watch = LeaderWatch(fleet.role, fleet.schedulers, margin_s=LEASE_S - STEP_DOWN_S)
        self.healed_at: float | None = None

    def steady(self, more: int, timeout: float = 30.0) -> None:
        """Wait for `more` complete answers."""
        n = self.traffic.answered("run") + more
        eventually(lambda: self.traffic.answered("run") >= n, timeout=timeout,
                   what=f"{more} more answers")  # fmt: skip

    def healed(self) -> None:
        self.healed_at = time.monotonic()

    def converged(self, cond, timeout: float = 60.0, what: str = "convergence") -> None:
        """Wait for `cond` after healing; its time is the table's convergence."""
        eventually(cond, timeout=timeout, interval=0.1, what=what)
        self.result.converged_s = time.monotonic() - self.healed_at

    def finish(self, usage_timeout: float = 30.0) -> Result:
        """Stop the traffic and check every invariant. Usage rows are waited for (a
        router writes them in batches, and one cut off from the store catches up)."""
        self.traffic.stop()
        self.watch.stop()
        r, sent = self.result, self.traffic.of("run")
        ok = {s.rid for s in sent if s.outcome == "ok"}
        try:
            eventually(lambda: ok <= set(self.rows200()), timeout=usage_timeout,
                       interval=0.5, what="a usage row for every complete answer")  # fmt: skip
        except AssertionError:
            pass  # counted as missing below
        r.clients(sent, self.rows200())
        f = self.f
        r.starts(f.logs(*f.schedulers), f.logs(*self.agents()))
        r.epochs({a: f.logs(a) for a in self.agents()})
        r.watched(self.watch)
        r.led({s: f.logs_apart(s) for s in f.schedulers})
        text = table([r])
        out = f.tmp / "partition.md"
        out.write_text(text + "\n\n" + "".join(f"- {b}\n" for b in r.broken))
        self.request.config.stash.setdefault(TABLES, []).append(text)
        print("\n" + text)
        return r

    def agents(self) -> list[str]:
        return [n for n in self.f.procs if n.startswith("a")]

    def rows200(self) -> list[str]:
        conn = psycopg2.connect(self.f.store, connect_timeout=3)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT request_id FROM usage WHERE status = 200")
                return [rid for (rid,) in cur.fetchall()]
        finally:
            conn.close()


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def engines(f: Fleet, model: str = "") -> dict[str, str]:
    """Replica id -> node, for every engine process that runs (by the agents' state
    files and the process table), of `model` or of any."""
    out = {}
    for node in f.procs:
        for s in f.shards(node):
            if alive(int(s.get("pid") or 0)) and (not model or s.get("model") == model):
                out[s["id"]] = node
    return out
