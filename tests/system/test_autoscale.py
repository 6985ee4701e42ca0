"""Autoscaling through the real scheduler, agents and router: a model saturated by its
clients gets a second replica that serves, and gives it back — drained, nothing lost —
when the load ends. The engine is the fake one, slowed to 200 ms an answer with two slots
a replica, as a small model on a busy CPU answers."""

import requests

from tests.helpers import eventually
from tests.system.conftest import GiB, Traffic

MODEL = "m"
# Saturated by queue wait (p90 over 0.3 s) as well as by busy slots. Busy slots are a
# sample of requests in flight at each router report, and on a loaded CI machine a
# sample that caught a replica between two requests broke the up window every time: the
# model never scaled up. Routers keep the queue-wait p90 over the last minute, so the
# scale-down comes about a minute after the load ends: the waits below allow for it.
SCALING = (
    "up_after_s = 1.0\ndown_below = 0.3\ndown_after_s = 3.0\ncooldown_s = 2.0\n"
    "target_queue_wait_s = 0.3\n"
)


def ready(c) -> list[dict]:
    return [r for r in c.admin("/v1/replicas") if r["model"] == MODEL and r["state"] == "ready"]


def served_by(endpoint: str) -> int:
    return requests.get(endpoint + "/_stats", timeout=5).json()["requests"]


def model(c) -> dict:
    return next(m for m in c.admin("/v1/models") if m["name"] == MODEL)


def test_a_saturated_model_gets_a_second_replica_and_gives_it_back_when_the_load_ends(
    cluster, api_key
):
    c = cluster
    slow = 'parallel = 2\nargs = ["--first-delay-s", "0.2", "--slots", "2"]\n'
    c.add_model(MODEL, memory=GiB, min_=1, max_=2, scaling=SCALING, profile=slow)
    c.start_scheduler()
    c.start_agent("node-a", memory=2 * GiB)
    c.start_agent("node-b", memory=2 * GiB)
    c.start_router(api_key[1])
    eventually(lambda: c.serves(MODEL), timeout=30, what="the model to be served")
    (first,) = ready(c)
    assert model(c)["desired"] == 1

    # Six clients back to back against two slots: saturated, the queue grows.
    heavy = [Traffic(c, MODEL, pause_s=0.0) for _ in range(6)]
    try:
        both = eventually(lambda: len(r := ready(c)) == 2 and r, timeout=60, interval=0.3,
                          what="a second replica to be ready")  # fmt: skip
        second = next(r for r in both if r["id"] != first["id"])
        m = model(c)
        assert m["desired"] == 2
        assert "saturated" in m["desired_reason"] or "scaled up" in m["desired_reason"]
        # The new replica takes its share of the load, not just a place in the table.
        start = served_by(second["endpoint"])
        eventually(lambda: served_by(second["endpoint"]) >= start + 5, timeout=30,
                   what="the second replica to answer requests")  # fmt: skip
    finally:
        for t in heavy:
            t.stop()
    assert sum(t.ok for t in heavy) > 0
    assert [f for t in heavy for f in t.failed] == []

    # The load ends; one light client stays. The model gives one replica back, by a
    # drain: the light client sees no failure while it goes.
    light = Traffic(c, MODEL, pause_s=0.2)
    try:
        eventually(lambda: len(ready(c)) == 1 and model(c)["desired"] == 1, timeout=150,
                   interval=0.3, what="the model to scale back to one replica")  # fmt: skip
        eventually(lambda: len([r for r in c.admin("/v1/replicas") if r["model"] == MODEL])
                   == 1, timeout=30, what="the given-back replica to be gone")  # fmt: skip
        ok_before = light.ok
        eventually(lambda: light.ok >= ok_before + 3, what="the last replica to keep serving")
    finally:
        light.stop()
    assert light.failed == []

    # Each decision is in the audit log, by the scheduler, with its reason.
    audit = c.admin("/v1/audit?limit=1000")
    actions = [(e["action"], e["actor"]) for e in audit if e["target"] == MODEL]
    assert ("models.scale_up", "scheduler") in actions
    assert ("models.scale_down", "scheduler") in actions
