"""A router in step with the scheduler's table is not sent whole tables, only diffs;
one that misses a diff asks for whole tables again (tools/router/feed.py)."""

import zmq

from llmgw import bus
from llmgw_router.feed import WHOLE, Feed
from llmgw_router.routing import RoutingTable
from tests.helpers import eventually, free_port


def whole(version, rids):
    replicas = [{"id": r, "model": "m", "endpoint": f"http://10.0.0.1:{8100 + i}", "key": "k",
                 "state": "ready"} for i, r in enumerate(rids)]  # fmt: skip
    body = {"seq": version, "table": "t1", "version": version, "replicas": replicas,
            "models": []}  # fmt: skip
    return bus.encode("routes", "scheduler", body)


def diff(version, base, removed):
    body = {"seq": version, "table": "t1", "version": version, "base": base, "replicas": [],
            "removed": removed}  # fmt: skip
    return bus.encode("routes_diff", "scheduler", body)


def test_the_whole_table_is_unsubscribed_once_held_and_subscribed_again_after_a_gap(tmp_path):
    bus.create_keypair(tmp_path, bus.SCHEDULER)
    bus.create_keypair(tmp_path, "router")
    ctx = zmq.Context()
    port = free_port()
    # An XPUB: the scheduler's PUB that also hands us the subscriptions it is sent.
    keys = bus.load_keypair(tmp_path, bus.SCHEDULER)
    pub = bus.serve(ctx, zmq.XPUB, f"tcp://127.0.0.1:{port}", keys)
    table = RoutingTable(fed=True)
    feed = Feed(table, [f"tcp://127.0.0.1:{port}"], bus.load_keypair(tmp_path, "router"),
                bus.load_public(tmp_path, "scheduler"))  # fmt: skip
    feed.start()
    seen = []

    def subscriptions():
        while pub.poll(0):
            seen.append(pub.recv())
        return seen

    try:
        eventually(lambda: b"\x01" + WHOLE in subscriptions(), what="a subscription to tables")

        def in_step():
            pub.send(whole(1, ["r-1", "r-2"]))
            return b"\x00" + WHOLE in subscriptions()

        eventually(in_step, what="the whole table unsubscribed once one was applied")
        assert sorted(ep.id for ep in table.endpoints()) == ["r-1", "r-2"]
        pub.send(diff(2, 1, ["r-1"]))
        eventually(lambda: [ep.id for ep in table.endpoints()] == ["r-2"], what="the diff")
        seen.clear()
        pub.send(diff(4, 3, ["r-2"]))  # version 3 never came
        eventually(lambda: b"\x01" + WHOLE in subscriptions(), what="tables asked for again")
        assert [ep.id for ep in table.endpoints()] == ["r-2"]  # the table held serves on
    finally:
        feed.stop()
        pub.close(0)
        ctx.term()
