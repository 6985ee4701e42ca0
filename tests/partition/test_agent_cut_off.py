"""Scenario 1: an agent cut off from both schedulers, still reachable by the routers and
the clients, under steady mixed traffic (docs/operate.md, "Partitions").

What must happen: the routers keep serving; after scheduler.node_lost_s the leader
marks the node lost, its replica counts toward nothing and a replacement is started
elsewhere (the catalog's min requires it); the orphan's engine keeps running on its
cut-off node. After healing the node reports its replica again, the model has one more
than its max, and the scheduler stops one of the two, never both: exactly what the
catalog wants runs again, and no replica id is ever started twice.
"""

import time

import pytest

from tests.helpers import eventually

from .fleet import HEARTBEAT_S, NODE_LOST_S
from .scenario import Scenario, engines

pytestmark = [pytest.mark.partition, pytest.mark.timeout(240)]


def test_an_agent_cut_off_from_the_schedulers_keeps_serving_and_its_orphan_is_adopted_or_drained(  # noqa: E501
    hosts, request
):
    f = hosts
    f.add_model("m", min_=2, max_=2)  # room for one replica on each of a1, a2, a3
    f.start()

    def ready() -> dict[str, str]:
        return {r["id"]: r["node"] for r in f.replicas() if r["state"] == "ready"}

    eventually(lambda: len(ready()) == 2, timeout=40, what="two ready replicas of m")
    f.slow_engines()
    before = ready()
    orphan, victim = next(iter(before.items()))
    sc = Scenario(f, request, f"{victim} cut off from s1 and s2")
    try:
        sc.steady(10)
        for s in f.schedulers:
            f.net.cut(victim, s)
        cut_at = time.monotonic()

        def lost() -> bool:
            return any(n["name"] == victim and n["state"] == "lost" for n in f.admin("/v1/nodes"))

        eventually(lost, timeout=NODE_LOST_S + 15, what=f"{victim} to be lost")
        # not before its timeout, counted from the last heartbeat heard (0.5 s apart)
        assert time.monotonic() - cut_at >= NODE_LOST_S - HEARTBEAT_S
        states = {r["id"]: r["state"] for r in f.replicas()}
        assert states[orphan] == "lost", states

        def replaced() -> str:
            return next((i for i, n in ready().items() if i not in before), "")

        replacement = eventually(replaced, timeout=40, what="a replacement of the orphan")
        f.slow_engines()
        # The orphan's engine runs on: its agent keeps what it was told to run.
        assert engines(f, "m").get(orphan) == victim
        sc.steady(20)

        for s in f.schedulers:
            f.net.heal(victim, s)
        sc.healed()

        def as_catalog() -> bool:
            """Two ready replicas of m, nothing lost or stopping, two engines running."""
            rs = f.replicas()
            return (
                len(rs) == 2
                and all(r["state"] == "ready" for r in rs)
                and len(engines(f, "m")) == 2
            )

        sc.converged(as_catalog, timeout=60, what="exactly two replicas of m after healing")
        kept = set(engines(f, "m"))
        assert len(kept & {orphan, replacement}) == 1, (kept, orphan, replacement)
        print(
            f"\n{orphan} on {victim}: {'adopted' if orphan in kept else 'drained'}, "
            f"its replacement {replacement}: {'kept' if replacement in kept else 'drained'}"
        )
        sc.steady(10)
    finally:
        result = sc.finish()
    assert not result.broken, "\n".join(result.broken)
