import random

from llmgw.placement import GiB, Need, NodeView
from llmgw.reconciler import (
    Backoff,
    Desired,
    ReplicaView,
    after_failure,
    after_success,
    reconcile,
)

LLAMA = "llama.cpp-0.3.36"


class Clock:
    """Fake time: the reconciler is given `now`, tests move it."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def want(model="m", min=1, max=None, gib=1) -> Desired:
    return Desired(model, min, min if max is None else max, Need(model, gib * GiB, 0, LLAMA))


def node(id, gib=16, state="installed", **kw) -> NodeView:
    return NodeView(id, memory_free=gib * GiB, engines={LLAMA: state} if state else {}, **kw)


def rep(id, model="m", node="a", state="ready", since=0.0) -> ReplicaView:
    return ReplicaView(id, model, node, state, since)


def run_passes(desired, nodes, clock, passes, backoff=None):
    """Apply each pass's starts as new pending replicas, as the scheduler would."""
    replicas, backoff = [], backoff or {}
    for i in range(passes):
        d = reconcile(desired, replicas, nodes, backoff, clock())
        for model, n, _ in d.starts:
            replicas.append(rep(f"r{len(replicas)}", model, n, "pending", clock()))
        clock.t += 1
        yield i, d, list(replicas)


def test_a_model_below_min_gets_one_start_per_pass_until_min():
    clock = Clock()
    nodes = [node("a"), node("b"), node("c")]
    counts = [len(reps) for _, _, reps in run_passes([want(min=3)], nodes, clock, 5)]
    assert counts == [1, 2, 3, 3, 3]


def test_starts_spread_over_nodes():
    clock = Clock()
    nodes = [node("a", gib=64), node("b")]
    starts = [d.starts for _, d, _ in run_passes([want(min=2)], nodes, clock, 2)]
    assert starts == [[("m", "a", False)], [("m", "b", False)]]


def test_a_start_on_a_node_without_the_engine_says_to_install_it_first():
    nodes = [node("a", state=None)]
    assert reconcile([want()], [], nodes, {}, 0.0).starts == [("m", "a", True)]


def test_an_installed_engine_is_preferred_over_spreading():
    clock = Clock()
    nodes = [node("a"), node("b", state=None)]
    starts = [d.starts for _, d, _ in run_passes([want(min=2)], nodes, clock, 2)]
    assert starts == [[("m", "a", False)], [("m", "a", False)]]


def test_no_start_while_the_model_backs_off():
    b = {"m": Backoff(failures=2, next_at=1010.0)}
    nodes = [node("a")]
    assert reconcile([want()], [], nodes, b, 1009.9).starts == []
    assert reconcile([want()], [], nodes, b, 1010.0).starts == [("m", "a", False)]


def test_backoff_doubles_is_capped_and_jittered_within_bounds():
    rng = random.Random(42)
    b, now = Backoff(), 100.0
    for failures in range(12):
        b = after_failure(b, now, rng, base=2.0, cap=60.0)
        full = min(60.0, 2.0 * 2**failures)
        assert b.failures == failures + 1
        assert now + full * 0.5 <= b.next_at <= now + full
    assert after_success(b) == Backoff()


def test_jitter_spreads_the_retries_of_models_that_failed_together():
    rng = random.Random(1)
    retries = {after_failure(Backoff(3), 0.0, rng, 1.0, 300.0).next_at for _ in range(20)}
    assert len(retries) == 20


def test_a_huge_failure_count_stays_at_the_cap():
    b = after_failure(Backoff(failures=5000), 0.0, random.Random(0), 1.0, 300.0)
    assert 150.0 <= b.next_at <= 300.0


def test_extras_above_max_stop_pending_then_starting_then_draining_nodes_then_newest():
    nodes = [node("a"), node("b", draining=True)]
    replicas = [
        rep("old", since=1), rep("new", since=5), rep("on-draining", node="b", since=0),
        rep("starting", state="starting", since=2), rep("pending", state="pending", since=3),
    ]  # fmt: skip
    for max_, stopped in [
        (4, ["pending"]),
        (3, ["pending", "starting"]),
        (2, ["pending", "starting", "on-draining"]),
        (1, ["pending", "starting", "on-draining", "new"]),
    ]:
        d = reconcile([want(min=1, max=max_)], replicas, nodes, {}, 0.0)
        assert d.stops == stopped
        assert d.starts == []


def test_replicas_on_lost_or_unknown_nodes_are_replaced():
    nodes = [node("a", lost=True), node("b")]
    replicas = [rep("r1", node="a"), rep("r2", node="gone")]
    d = reconcile([want(min=1)], replicas, nodes, {}, 0.0)
    assert d.starts == [("m", "b", False)]
    assert d.stops == []


def test_failed_stopped_and_draining_replicas_do_not_count():
    nodes = [node("a")]
    replicas = [rep("f", state="failed"), rep("s", state="stopped"), rep("d", state="draining")]
    d = reconcile([want(min=1)], replicas, nodes, {}, 0.0)
    assert d.starts == [("m", "a", False)] and d.stops == []


def test_a_model_that_fits_nowhere_is_reported_with_each_nodes_reason():
    nodes = [node("a", gib=1), node("b", state="failed: disk full"), node("c", lost=True)]
    d = reconcile([want(gib=4)], [], nodes, {}, 0.0)
    assert d.starts == []
    assert d.unplaceable == {"m": {
        "a": "needs 4 GiB, 1 GiB free",
        "b": "llama.cpp 0.3.36 failed to install: disk full",
        "c": "lost",
    }}  # fmt: skip


def test_replicas_of_models_no_longer_desired_are_stopped():
    nodes = [node("a")]
    replicas = [rep("keep"), rep("old1", model="gone"), rep("old2", model="gone", state="pending")]
    d = reconcile([want(min=1)], replicas, nodes, {}, 0.0)
    assert d.stops == ["old1", "old2"]


def test_no_start_is_returned_while_the_engine_installs_on_the_chosen_node():
    nodes = [node("a", state="installing")]
    d = reconcile([want()], [], nodes, {}, 0.0)
    assert d.starts == [] and d.unplaceable == {}
    nodes = [node("a", state="installing"), node("b", gib=2)]
    assert reconcile([want()], [], nodes, {}, 0.0).starts == [("m", "b", False)]


def test_later_models_in_a_pass_see_the_memory_earlier_ones_took():
    nodes = [node("a", gib=3), node("b", gib=2)]
    d = reconcile([want("x", gib=2), want("y", gib=2), want("z", gib=2)], [], nodes, {}, 0.0)
    assert d.starts == [("x", "a", False), ("y", "b", False)]
    assert set(d.unplaceable) == {"z"}


def test_models_with_no_replica_are_placed_before_models_with_some():
    nodes = [node("a", gib=2)]
    desired = [want("some", min=2, gib=2), want("none", min=1, gib=2)]
    d = reconcile(desired, [rep("r", model="some", node="elsewhere-lost")], nodes, {}, 0.0)
    assert d.starts == [("some", "a", False)]  # its replica is on an unknown node: zero too
    live = [NodeView("z", memory_free=0, engines={LLAMA: "installed"}), *nodes]
    d = reconcile(desired, [rep("r", model="some", node="z")], live, {}, 0.0)
    assert d.starts == [("none", "a", False)]


def test_spread_counts_the_replicas_already_running():
    nodes = [node("a", gib=64), node("b", gib=8)]
    d = reconcile([want(min=2)], [rep("r", node="a")], nodes, {}, 0.0)
    assert d.starts == [("m", "b", False)]
