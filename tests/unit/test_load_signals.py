"""What routers tell the autoscaler (in flight and slots per replica, queue wait p90)
and how the scheduler sums it over routers."""

import collections

from llmgw_router.admission import Admission
from llmgw_router.probe import Signal, replica_load
from llmgw_router.routing import Endpoint
from llmgw_scheduler.load import Loads


def test_a_router_reports_its_in_flight_and_the_engines_slots_where_it_knows_them():
    fresh = Endpoint("r1", "http://a:1", ("chat",), outstanding=3)
    fresh.signal = Signal(slots=8, busy=5, at=100.0)
    unknown = Endpoint("r2", "http://b:1", ("chat",), outstanding=1)
    stale = Endpoint("r3", "http://c:1", ("chat",))
    stale.signal = Signal(slots=8, at=10.0)
    load = replica_load([fresh, unknown, stale], lambda ep: 4, wall=101.0)
    assert load == {"r1": [3, 8], "r2": [1, 4], "r3": [0, 4]}


def test_the_queue_wait_p90_counts_only_the_last_minute():
    adm = Admission(["default"], capacity=lambda m: 1)
    adm.waits["chat"] = collections.deque([(10.0, 99.0)] + [(100.0, float(i)) for i in range(10)])
    assert adm.wait_p90(105.0) == {"chat": 9.0}
    assert adm.wait_p90(200.0) == {}


def test_load_is_summed_over_routers_and_a_silent_router_is_left_out():
    loads = Loads()
    loads.report("r-a", {"replica_load": {"x": [2, 4], "y": [0, 4]},
                         "queue_wait_p90_s": {"chat": 1.5}}, 100.0)  # fmt: skip
    loads.report("r-b", {"replica_load": {"x": [2, 4], "y": [1, 4]},
                         "queue_wait_p90_s": {"alias": 6.0}}, 104.0)  # fmt: skip
    both = loads.load(("chat", "alias"), ["x", "y"], 105.0)
    assert (both.replicas, both.busy, both.inflight, both.slots) == (2, 1, 5, 8)
    assert both.queue_wait_p90_s == 6.0
    one = loads.load(("chat", "alias"), ["x", "y"], 112.0)  # r-a is 12 s old
    assert (one.busy, one.inflight, one.queue_wait_p90_s) == (0, 3, 6.0)
    assert loads.load(("chat",), ["x"], 200.0) is None


def test_a_report_without_load_from_an_older_router_changes_nothing():
    loads = Loads()
    loads.report("old", {"idle_s": {"chat": 1.0}}, 100.0)
    assert loads.reports == {}


def test_a_routers_load_report_names_each_replica_and_model():
    from types import SimpleNamespace

    from llmgw_router.app import load_report
    from llmgw_router.routing import RoutingTable

    table = RoutingTable()
    table.replace([Endpoint("r1", "http://a:1", ("chat",)), Endpoint("r2", "http://b:1", ("x",))],
                  {})  # fmt: skip
    policies = SimpleNamespace(
        model=lambda name: SimpleNamespace(parallel=4) if name == "chat" else None
    )
    adm = Admission(["default"], capacity=lambda m: 1)
    report = load_report(table, policies, adm, SimpleNamespace(slots_per_replica=2))
    assert report == {"replica_load": {"r1": [0, 4], "r2": [0, 2]}, "queue_wait_p90_s": {}}
