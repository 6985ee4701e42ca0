"""Scenario 2: a router cut off from both schedulers and from PostgreSQL, still reachable
by the clients and the engines, under steady mixed traffic (docs/operate.md,
"Partitions").

What must happen: it stays ready and serves from its last routing table; every usage row
waits in its spool (llmgw_router_usage_rows_pending rises); after healing it writes them,
and every complete answer any client saw has exactly one usage row. A request for an
on-demand model it cannot ask a scheduler for is answered at once with a clear error,
not held for the activation window (a test of its own below).
"""

import time

import pytest
import requests

from tests.helpers import eventually

from .fleet import GiB
from .scenario import Scenario

pytestmark = [pytest.mark.partition, pytest.mark.timeout(240)]


def cut_off(f, router: str) -> None:
    for other in [*f.schedulers, "pg"]:
        f.net.cut(router, other)


def heal(f, router: str) -> None:
    for other in [*f.schedulers, "pg"]:
        f.net.heal(router, other)


def pending(f, router: str) -> float:
    """The router's usage rows not yet in the store (its /metrics)."""
    text = requests.get(f"{f.router_url(router)}/metrics", timeout=2).text
    for line in text.splitlines():
        if line.startswith("llmgw_router_usage_rows_pending "):
            return float(line.split()[1])
    return 0.0


def ask(f, router: str, model: str, timeout: float) -> requests.Response:
    return requests.post(
        f"{f.router_url(router)}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {f.secret}"},
        timeout=timeout,
    )


def test_a_router_cut_off_from_the_schedulers_and_the_store_serves_spools_and_catches_up(
    hosts, request
):
    f = hosts
    f.add_model("m", min_=2, max_=2)
    f.start()
    eventually(lambda: sum(r["state"] == "ready" for r in f.replicas()) == 2, timeout=40,
               what="two ready replicas of m")  # fmt: skip
    for r in f.routers:
        eventually(lambda r=r: ask(f, r, "m", 5).status_code == 200, timeout=20,
                   what=f"{r} to serve m")  # fmt: skip
    f.slow_engines()
    sc = Scenario(f, request, "r1 cut off from s1, s2 and pg")
    try:
        sc.steady(10)
        cut_off(f, "r1")
        through_r1 = sc.traffic.answered("run", router=0)
        # It serves from its last table, and its rows wait in its spool.
        eventually(lambda: sc.traffic.answered("run", router=0) >= through_r1 + 20,
                   timeout=30, what="20 more answers through r1")  # fmt: skip
        assert pending(f, "r1") > 0
        eventually(lambda: requests.get(f"{f.router_url('r1')}/ready", timeout=2).ok,
                   timeout=5, what="r1 to say it is ready")  # fmt: skip
        heal(f, "r1")
        sc.healed()
        sc.converged(lambda: pending(f, "r1") == 0, timeout=90,
                     what="r1's spooled usage rows in the store")  # fmt: skip
        sc.steady(10)
    finally:
        result = sc.finish()
    assert not result.broken, "\n".join(result.broken)


def test_a_router_cut_off_from_the_schedulers_answers_an_on_demand_model_at_once(hosts):
    """An on-demand model (min 0, not running) it cannot ask a scheduler for: a clear
    error at once rather than the activation window's 20 s wait, and after healing the
    model is activated through it as usual."""
    f = hosts
    f.add_model("m")
    f.add_model("od", memory=GiB // 4, min_=0, max_=1, keep_alive=300.0)
    f.start(agents=("a1", "a2"), routers=("r1",))
    eventually(lambda: ask(f, "r1", "m", 5).status_code == 200, timeout=40,
               what="r1 to serve m")  # fmt: skip
    assert not [r for r in f.replicas() if r["model"] == "od"]
    cut_off(f, "r1")

    def refused_at_once():
        t0 = time.monotonic()
        r = ask(f, "r1", "od", timeout=5)
        took = time.monotonic() - t0
        return took < 5 and r.status_code >= 400 and r.json()["error"]["message"] and (r, took)

    try:
        answer, took = eventually(refused_at_once, timeout=30, what="od refused at once")
    finally:
        heal(f, "r1")
    print(f"\nod through r1 cut off: HTTP {answer.status_code} in {took:.2f} s: {answer.text}")
    assert ask(f, "r1", "m", 5).status_code == 200  # what runs is served meanwhile
    eventually(lambda: ask(f, "r1", "od", 25).status_code == 200, timeout=60,
               what="od activated through r1 after healing")  # fmt: skip
