"""Scenario 3: the leading scheduler cut off from PostgreSQL (the pg host), still
reachable by its agents and the routers, under steady mixed traffic (docs/operate.md,
"Partitions").

What must happen: the leader cannot renew its lease, so it stops acting step_down_s
after its last successful renewal (on its own clock, whether or not its store calls
return); the standby takes the lease once it has run out (lease_s after that renewal, on
the store's clock) with the next epoch and tells every agent. Commands are sent around
the takeover: the new leader drains a node, so one replica is started elsewhere and the
drained one stopped, and the old leader, which still hears the agents' heartbeats, sees
one replica more than the catalog wants: if it still acted it would stop one, with the
old epoch. No agent may accept a command of the old epoch after one of the new. After
healing the old leader stands by.
"""

import re
import time

import pytest

from tests.helpers import eventually

from .fleet import STEP_DOWN_S
from .scenario import Scenario, engines

pytestmark = [pytest.mark.partition, pytest.mark.timeout(240)]

STAMPED_ACCEPT = re.compile(r"^(\d+\.\d+) .*: command_accepted type=(\S+) epoch=(\d+)", re.M)


def test_a_leader_cut_off_from_postgresql_stops_acting_and_the_standby_takes_over(hosts, request):
    f = hosts
    f.add_model("m", min_=2, max_=2)  # room for one replica on each of a1, a2, a3
    f.start()

    def ready() -> dict[str, str]:
        return {r["id"]: r["node"] for r in f.replicas() if r["state"] == "ready"}

    eventually(lambda: len(ready()) == 2, timeout=40, what="two ready replicas of m")
    f.slow_engines()
    old = f.admin("/v1/status", scheduler="s1")["control_plane"]["epoch"]
    drained = next(iter(ready().values()))
    sc = Scenario(f, request, "s1 (leading) cut off from pg")
    try:
        sc.steady(10)
        cut_wall = time.time()
        f.net.cut("s1", "pg")
        eventually(lambda: f.role("s2") == "leader", timeout=20, what="s2 to take over")
        took = time.time() - cut_wall
        assert f.role("s1") != "leader"
        new = f.admin("/v1/status", scheduler="s2")["control_plane"]["epoch"]
        assert new == old + 1, (old, new)
        # Commands of the new epoch, right after the takeover.
        r = f.ctl("drain", drained, scheduler="s2")
        assert r.returncode == 0, r.stderr

        def moved() -> bool:
            rs = f.replicas("s2")
            return (len([x for x in rs if x["state"] == "ready"]) == 2
                    and drained not in {x["node"] for x in rs}
                    and drained not in engines(f, "m").values())  # fmt: skip

        eventually(moved, timeout=40, what=f"m's replica moved off {drained} by s2")
        f.slow_engines()
        sc.steady(10)
        f.net.heal("s1", "pg")
        sc.healed()
        sc.converged(lambda: f.role("s1") == "standby", timeout=90,
                     what="s1 to stand by after healing")  # fmt: skip
        sc.steady(10)
    finally:
        result = sc.finish()
    print(f"\ns2 led {took:.1f} s after the cut (epoch {old} -> {new})")

    # It stopped acting within its lease: by its own word (stepped_down says when it
    # stopped), and by what the agents accepted of its epoch, both at most step_down_s
    # after the cut (its last renewal began before the cut), with 0.5 s for the clocks.
    said = rf"^(\d+\.\d+) .*: stepped_down epoch={old} .*stopped_s_ago=([\d.]+)"
    (line,) = re.findall(said, f.logs("s1"), re.M)
    stopped = float(line[0]) - float(line[1])
    assert stopped - cut_wall <= STEP_DOWN_S + 0.5, (stopped, cut_wall)
    accepted = {a: STAMPED_ACCEPT.findall(f.logs(a)) for a in sc.agents()}
    last_old = max(float(t) for rows in accepted.values() for t, _, e in rows if int(e) == old)
    assert last_old - cut_wall <= STEP_DOWN_S + 0.5, (last_old, cut_wall)
    # The stale-epoch count could have failed: the drain's commands carried the new
    # epoch to the agents that had the old one's.
    kinds = {(k, int(e)) for rows in accepted.values() for _, k, e in rows}
    assert ("start_shard", old) in kinds and ("start_shard", new) in kinds, kinds
    assert ("stop_shard", new) in kinds, kinds
    assert not result.broken, "\n".join(result.broken)
