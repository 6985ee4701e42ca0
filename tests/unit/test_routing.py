import time

import pytest

from llmgw_router.probe import Signal
from llmgw_router.routing import Endpoint, RoutingTable, _others, parse_endpoint_flag


def table(*specs, cooldown_s=5.0):
    return RoutingTable([Endpoint(i, f"http://{i}", tuple(ms)) for i, ms in specs], cooldown_s)


def test_the_endpoint_with_fewest_outstanding_requests_is_chosen():
    t = table(("a", ["m"]), ("b", ["m"]), ("c", ["m"]))
    eps = {e.id: e for e in t.endpoints()}
    eps["a"].outstanding, eps["b"].outstanding, eps["c"].outstanding = 3, 1, 2
    assert t.pick("m", now=0).id == "b"


def test_ties_rotate_so_light_traffic_reaches_every_endpoint():
    t = table(("a", ["m"]), ("b", ["m"]))
    assert {t.pick("m", now=0).id for _ in range(4)} == {"a", "b"}


def test_an_endpoint_that_failed_is_avoided_until_its_cooldown_ends():
    t = table(("a", ["m"]), ("b", ["m"]), cooldown_s=5)
    a = next(e for e in t.endpoints() if e.id == "a")
    t.failed(a, now=100)
    assert {t.pick("m", now=101).id for _ in range(4)} == {"b"}
    assert "a" in {t.pick("m", now=106).id for _ in range(4)}


def test_no_endpoint_is_offered_when_all_are_cooling_and_retry_after_says_when():
    t = table(("a", ["m"]), cooldown_s=5)
    t.failed(t.endpoints()[0], now=100)
    assert t.pick("m", now=102) is None
    assert t.retry_after("m", now=102) == pytest.approx(3)


def test_excluded_endpoints_are_not_offered_again_in_the_same_request():
    t = table(("a", ["m"]), ("b", ["m"]))
    first = t.pick("m", now=0)
    second = t.pick("m", now=0, exclude=[first])
    assert second is not None and second is not first
    assert t.pick("m", now=0, exclude=[first, second]) is None


def test_replacing_the_table_keeps_the_counters_of_endpoints_that_stay():
    t = table(("a", ["m"]))
    t.endpoints()[0].outstanding = 4
    t.replace([Endpoint("a", "http://a", ("m", "n")), Endpoint("b", "http://b", ("n",))])
    assert t.models() == ["m", "n"]
    assert next(e for e in t.endpoints() if e.id == "a").outstanding == 4


def test_a_request_in_flight_across_a_table_change_is_not_counted_after_it_ends():
    # What call.py does: count the request on the endpoint it picked, uncount it there
    # when it ends. A table snapshot arriving in between must not keep it counted.
    t = table(("a", ["m"]))
    ep = t.pick("m", now=0)
    ep.outstanding += 1
    t.replace([Endpoint("a", "http://a", ("m",), key="new-key")])
    ep.outstanding -= 1
    (now,) = t.endpoints()
    assert now.outstanding == 0
    assert now.key == "new-key" and b"new-key" in now.head  # the rest is the new table's


def test_a_new_table_keeps_when_each_endpoint_was_last_used():
    # The scheduler learns a replica was used from the next activity report; a table
    # snapshot arriving between the request and that report must not forget it.
    t = table(("a", ["m"]))
    t.endpoints()[0].last_used = 123.5
    t.replace([Endpoint("a", "http://a", ("m",))])
    assert t.endpoints()[0].last_used == 123.5


def test_the_endpoint_flag_takes_id_url_and_models():
    ep = parse_endpoint_flag("g0=http://127.0.0.1:8011/=gemma,gemma-alias")
    assert (ep.id, ep.url, ep.models) == ("g0", "http://127.0.0.1:8011", ("gemma", "gemma-alias"))


@pytest.mark.parametrize("bad", ["g0=http://x", "g0=localhost:1=m", "=http://x=m"])
def test_a_malformed_endpoint_flag_says_what_it_wants(bad):
    with pytest.raises(ValueError, match="ID=URL=MODEL|http://"):
        parse_endpoint_flag(bad)


def test_a_fed_table_has_no_table_until_the_feed_sends_one_and_wakes_who_waits():
    import asyncio

    assert RoutingTable([], fed=False).has_table  # nothing to wait for
    assert RoutingTable([Endpoint("a", "http://x", ("m",))], fed=True).has_table  # static
    table = RoutingTable([], fed=True)
    assert not table.has_table

    async def scenario():
        assert not await table.wait_table(0.01)
        waiting = asyncio.ensure_future(table.wait_table(5))
        await asyncio.sleep(0)  # let it start waiting
        table.replace([], {})  # the first table: empty, but a table
        return await waiting

    assert asyncio.run(scenario()) is True
    assert table.has_table


def test_the_engine_key_is_never_in_an_endpoints_repr_or_a_replicas():
    from llmgw_scheduler.inventory import Replica

    ep = Endpoint("r1", "http://x", ("m",), "engine-s3cret")
    assert b"engine-s3cret" in ep.head  # it is sent to the engine...
    assert "engine-s3cret" not in repr(ep) and "engine-s3cret" not in str([ep])  # ...only
    replica = Replica("r1", "m", "n1", "default", "ready", 0.0, key="engine-s3cret")
    assert "engine-s3cret" not in repr(replica)


def test_round_robin_takes_each_endpoint_in_turn_whatever_their_load():
    t = RoutingTable([Endpoint(i, f"http://{i}", ("m",)) for i in "ab"], routing="round-robin")
    t.endpoints()[0].outstanding = 5
    assert [t.pick("m", now=0).id for _ in range(4)].count("a") == 2


def test_prefix_routing_sends_a_conversation_back_where_its_prompt_went():
    t = RoutingTable([Endpoint(i, f"http://{i}", ("m",)) for i in "ab"], routing="prefix")
    system = {"role": "system", "content": "Be brief. " * 100}
    first = {"model": "m", "messages": [system, {"role": "user", "content": "hi"}]}
    k1 = t.key(first)
    ep = t.pick("m", now=0, key=k1)
    t.served(ep, k1, 300, 0)
    later = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "yo"}]}
    for _ in range(3):
        k = t.key(later)
        assert t.pick("m", now=0, key=k) is ep
        t.served(ep, k, 300, 250)


def test_prefix_routing_sends_a_request_without_a_prompt_to_the_least_outstanding():
    t = RoutingTable([Endpoint(i, f"http://{i}", ("m",)) for i in "ab"], routing="prefix")
    t.endpoints()[0].outstanding = 2
    assert t.key({"model": "m", "input": ["an", "embedding"]}) is None
    assert [t.pick("m", now=0).id for _ in range(4)] == ["b"] * 4


def test_an_unknown_routing_is_refused_with_the_ones_there_are():
    with pytest.raises(ValueError, match="least-outstanding, prefix, round-robin"):
        RoutingTable([], routing="random")


def test_least_outstanding_routing_computes_no_prefix_key():
    assert RoutingTable([]).key({"model": "m", "prompt": "x"}) is None


def test_other_routers_requests_are_the_engines_busy_slots_less_ours_when_it_answered():
    ep = Endpoint("a", "http://a", ("m",))
    now = time.time()
    ep.signal = Signal(slots=4, busy=3, at=now, own=1)
    ep.outstanding = 0  # ours ended since the probe: it still says two are someone else's
    assert _others(now)(ep) == 2
    ep.signal = Signal(slots=4, busy=2, at=now, own=2)  # all of them ours
    assert _others(now)(ep) == 0
    ep.signal = Signal(slots=4, busy=3, at=now - 60, own=0)  # too old to believe
    assert _others(now)(ep) == 0


def test_an_engine_without_slots_counts_its_running_and_waiting_requests_as_other_routers():
    ep = Endpoint("a", "http://a", ("m",))
    now = time.time()
    ep.signal = Signal(busy=2, waiting=3, at=now, own=1)  # vLLM: no slot count, a queue
    assert _others(now)(ep) == 4


def test_least_outstanding_counts_the_requests_other_routers_have_on_an_engine():
    """A second router sent new requests to the engine the first kept busy, as its own
    count of requests there was 0 (bench/ROUTING-RUNS.md, two routers)."""
    t = table(("a", ["m"]), ("b", ["m"]))
    eps = {e.id: e for e in t.endpoints()}
    eps["a"].outstanding = 1
    eps["b"].signal = Signal(slots=4, busy=3, waiting=0, at=time.time(), own=0)
    assert {t.pick("m", now=0).id for _ in range(4)} == {"a"}
    eps["b"].signal.at = time.time() - 60  # stale: its word no longer counts
    assert {t.pick("m", now=0).id for _ in range(4)} == {"b"}
