from llmgw import bus
from llmgw_router.feed import SILENCE_S, Feed
from llmgw_router.routing import Endpoint, RoutingTable


def routes(seq, replicas, models=(), epoch=0):
    return bus.encode(
        "routes", "scheduler", {"seq": seq, "replicas": replicas, "models": list(models)}, epoch
    )


def replica(rid, model, state="ready", aliases=()):
    return {
        "id": rid,
        "model": model,
        "aliases": list(aliases),
        "endpoint": f"http://10.0.0.1:{8100 + len(rid)}",
        "key": "k" * 64,
        "state": state,
    }


def feed_for(table, static=()):
    return Feed(table, [], keys=None, server_public="", static=list(static))


def test_a_routes_table_installs_ready_replicas_with_their_aliases_and_keys():
    table = RoutingTable()
    assert feed_for(table).handle(
        routes(1, [replica("r-1", "m", aliases=["m-alias"]), replica("r-2", "m", state="starting")])
    )
    (ep,) = table.endpoints()
    assert ep.id == "r-1" and ep.models == ("m", "m-alias")
    assert b"Authorization: Bearer " + b"k" * 64 in ep.head
    assert table.serves("m-alias")


def test_a_model_in_the_catalog_without_a_ready_replica_is_known_but_not_served():
    table = RoutingTable()
    feed_for(table).handle(
        routes(
            1, [], models=[{"name": "m", "aliases": ["a"], "state": "parked", "reason": "exit 1"}]
        )
    )
    assert table.knows("a") and not table.serves("m")
    assert table.status("a") == ("parked", "exit 1")
    assert not table.knows("other") and table.status("other") is None


def test_static_endpoints_stay_beside_the_schedulers_table():
    table = RoutingTable()
    static = Endpoint("s", "http://127.0.0.1:1", ("static-model",))
    feed_for(table, [static]).handle(routes(2, [replica("r-1", "m")]))
    assert table.serves("static-model") and table.serves("m")


def test_a_newer_table_replaces_the_older_one_whole():
    table = RoutingTable()
    feed = feed_for(table)
    feed.handle(routes(1, [replica("r-1", "m")]))
    feed.handle(routes(2, [replica("r-2", "n")]))
    assert [e.id for e in table.endpoints()] == ["r-2"]
    assert not table.serves("m")


def test_garbage_and_other_messages_change_nothing():
    table = RoutingTable()
    feed = feed_for(table)
    feed.handle(routes(1, [replica("r-1", "m")]))
    assert not feed.handle(b"not json")
    assert not feed.handle(bus.encode("heartbeat", "x", {}))
    assert table.serves("m")


def test_only_the_newest_leader_s_table_counts_whatever_order_they_arrive_in():
    table = RoutingTable()
    feed = feed_for(table)
    assert feed.handle(routes(40, [replica("r-old", "m")], epoch=3))
    # A new leader starts its sequence again: its epoch makes it newer.
    assert feed.handle(routes(1, [replica("r-new", "m")], epoch=4))
    assert [ep.id for ep in table.endpoints()] == ["r-new"]
    # The deposed leader, woken up, publishes once more: ignored.
    assert not feed.handle(routes(41, [replica("r-old", "m")], epoch=3))
    assert [ep.id for ep in table.endpoints()] == ["r-new"]
    # The same table again (the periodic snapshot) is applied as before.
    assert feed.handle(routes(1, [replica("r-new", "m")], epoch=4))


def test_of_tables_that_queued_up_the_newest_by_epoch_and_sequence_is_taken():
    from llmgw_router.feed import _newest

    batch = [routes(5, [], epoch=2), routes(1, [], epoch=3), routes(9, [], epoch=2)]
    assert bus.decode(_newest(batch))["epoch"] == 3
    assert bus.decode(_newest(batch[:1]))["body"]["seq"] == 5


class _Dealer:
    def __init__(self):
        self.sent = []

    def send(self, data, flags=0):
        self.sent.append(bus.decode(data))


def test_each_activity_report_carries_the_load_for_the_autoscaler():
    table = RoutingTable()
    feed = feed_for(table)
    feed.used("chat", 0.0)
    feed.load = lambda: {"replica_load": {"r1": [2, 4]}, "queue_wait_p90_s": {"chat": 1.5}}
    dealer = _Dealer()
    feed._send_activity([dealer])
    (msg,) = dealer.sent
    assert msg["type"] == "activity"
    assert msg["body"]["replica_load"] == {"r1": [2, 4]}
    assert msg["body"]["queue_wait_p90_s"] == {"chat": 1.5}
    assert "chat" in msg["body"]["idle_s"]
    feed.stop()


# -- diffs (tools/scheduler/published.py makes them) ---------------------------------------


def whole(version, replicas, models=(), epoch=0, table="t1"):
    body = {"seq": version, "table": table, "version": version, "replicas": replicas,
            "models": list(models)}  # fmt: skip
    return bus.encode("routes", "scheduler", body, epoch)


def diff(version, base, replicas=(), removed=(), table="t1", epoch=0, **extra):
    body = {"seq": version, "table": table, "version": version, "base": base,
            "replicas": list(replicas), "removed": list(removed), **extra}  # fmt: skip
    return bus.encode("routes_diff", "scheduler", body, epoch)


def test_a_diff_from_the_table_held_adds_changes_and_removes_replicas():
    table = RoutingTable()
    feed = feed_for(table)
    feed.handle(whole(1, [replica("r-1", "m"), replica("r-2", "m"), replica("r-33", "n")],
                      models=[{"name": "m", "state": "serving"}]))  # fmt: skip
    kept = {ep.id: ep for ep in table.endpoints()}["r-1"]
    kept.outstanding = 2
    rekeyed = {**replica("r-2", "m"), "key": "x" * 64}
    assert feed.handle(diff(2, 1, [replica("r-4", "n"), rekeyed], removed=["r-33"]))
    eps = {ep.id: ep for ep in table.endpoints()}
    assert sorted(eps) == ["r-1", "r-2", "r-4"]
    assert eps["r-1"] is kept and kept.outstanding == 2  # untouched: the same endpoint
    assert b"Bearer " + b"x" * 64 in eps["r-2"].head
    # A diff without models leaves the catalog's word as it was.
    assert table.status("m") == ("serving", "")
    assert feed.handle(diff(3, 2, models=[{"name": "m", "state": "parked", "reason": "no"}]))
    assert table.status("m") == ("parked", "no") and table.serves("n")


def test_a_diff_that_does_not_start_from_the_table_held_is_not_applied_until_a_whole_one():
    table = RoutingTable()
    feed = feed_for(table)
    feed.handle(whole(1, [replica("r-1", "m")]))
    assert not feed._whole_wanted  # in step: diffs only
    # Version 2 was missed: 3 would be applied to a table the router does not hold.
    assert not feed.handle(diff(3, 2, [replica("r-2", "n")], removed=["r-1"]))
    assert [ep.id for ep in table.endpoints()] == ["r-1"]
    assert feed._whole_wanted
    assert feed.handle(whole(3, [replica("r-2", "n")]))
    assert feed.handle(diff(4, 3, [replica("r-5", "n")]))
    assert sorted(ep.id for ep in table.endpoints()) == ["r-2", "r-5"]


def test_a_diff_of_another_scheduler_s_table_is_not_applied_even_if_its_base_matches():
    table = RoutingTable()
    feed = feed_for(table)
    feed.handle(whole(5, [replica("r-1", "m")], table="before-restart"))
    assert not feed.handle(diff(6, 5, removed=["r-1"], table="after-restart"))
    assert table.serves("m") and feed._whole_wanted


def test_a_scheduler_that_sends_no_diffs_keeps_the_router_on_whole_tables():
    table = RoutingTable()
    feed = feed_for(table)
    assert feed.handle(routes(1, [replica("r-1", "m")]))
    assert feed._whole_wanted


def test_a_diff_from_a_deposed_leader_is_ignored():
    table = RoutingTable()
    feed = feed_for(table)
    feed.handle(whole(1, [replica("r-1", "m")], epoch=4, table="new"))
    assert not feed.handle(diff(9, 8, removed=["r-1"], epoch=3, table="old"))
    assert table.serves("m") and not feed._whole_wanted


def test_of_messages_that_queued_up_every_diff_and_only_the_newest_whole_table_are_applied():
    from llmgw_router.feed import _to_apply

    batch = [whole(1, []), diff(2, 1), whole(2, []), diff(3, 2)]
    assert _to_apply(batch) == [batch[1], batch[2], batch[3]]
    assert _to_apply(batch[:2]) == batch[:2]


def test_the_topics_a_router_subscribes_to_are_how_messages_of_each_type_begin():
    assert diff(2, 1).startswith(bus.topic("routes_diff"))
    assert whole(1, []).startswith(bus.topic("routes"))
    assert not diff(2, 1).startswith(bus.topic("routes"))


def test_a_feed_that_hears_no_table_past_the_silence_threshold_is_cut_off_until_one_comes():
    table = RoutingTable()
    feed = feed_for(table)
    cut = []
    feed.on_cut_off = lambda: cut.append(1)
    assert feed.handle(routes(1, [replica("r-1", "m")], epoch=2))
    t = feed.heard_at
    assert not feed.cut_off(t + SILENCE_S) and feed.silent_s(t + 4.0) == 4.0
    assert feed.cut_off(t + SILENCE_S + 0.1)
    feed._check_silence(t + SILENCE_S + 0.1)
    feed._check_silence(t + SILENCE_S + 5.0)
    assert cut == [1]  # said once, not on every pass
    # A deposed leader's table is not the control plane coming back.
    assert not feed.handle(routes(9, [], epoch=1))
    assert feed.heard_at == t
    assert feed.handle(routes(2, [replica("r-1", "m")], epoch=2))
    assert not feed.cut_off() and feed.heard_at > t
    feed._check_silence(feed.heard_at + SILENCE_S + 0.1)
    assert cut == [1, 1]  # a new silence is a new cut
