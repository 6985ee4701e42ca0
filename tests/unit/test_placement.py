import random

from llmgw.placement import (
    Fleet,
    GiB,
    Need,
    NodeView,
    gpus_needed,
    gpus_of,
    place,
    place_many,
    why_not,
)
from tests import third_engine

LLAMA = "llama.cpp-0.3.36"
VLLM = "vllm-0.6.3"


def cpu(model="m", gib=1.0, engine=LLAMA) -> Need:
    return Need(model, int(gib * GiB), 0, engine)


def node(id, gib=8.0, engine_state="installed", **kw) -> NodeView:
    engines = kw.pop("engines", {LLAMA: engine_state} if engine_state else {})
    return NodeView(id, memory_free=int(gib * GiB), engines=engines, **kw)


def test_a_lost_node_is_reported_as_lost():
    assert why_not(cpu(), node("a", lost=True)) == "lost"


def test_a_draining_node_is_reported_as_draining():
    assert why_not(cpu(), node("a", draining=True)) == "draining"


def test_too_little_memory_says_how_much_is_needed_and_free():
    n = NodeView("a", memory_free=int(1.4 * GiB))
    assert why_not(cpu(gib=2.1), n) == "needs 2.1 GiB, 1.4 GiB free"


def test_memory_figures_that_round_alike_get_another_decimal():
    n = NodeView("a", memory_free=int(2.04 * GiB))
    assert why_not(cpu(gib=2.05), n) == "needs 2.05 GiB, 2.04 GiB free"


def test_too_few_gpus_says_how_many_are_needed_and_present():
    n = NodeView("a", gpus=gpus_of(80 * GiB))
    assert why_not(Need("m", 10 * GiB, 4, VLLM), n) == "needs 4 GPUs, has 1"


def test_gpus_without_enough_free_memory_are_reported_with_the_memory():
    n = NodeView("a", gpus=gpus_of(80 * GiB, 20 * GiB))
    assert why_not(Need("m", 40 * GiB, 2, VLLM), n) == "needs 2 GPUs with 40 GiB free, has 1"


def test_a_gpu_only_engine_on_a_node_without_gpus_needs_gpus():
    n = NodeView("a", memory_free=100 * GiB)
    third_engine.register()
    try:
        assert why_not(Need("m", GiB, 0, "third-1"), n) == "needs 1 GPU, has 0"
        assert why_not(Need("m", GiB, 2, "third-1"), n) == "needs 2 GPUs, has 0"
    finally:
        third_engine.unregister()


def test_vllm_without_gpus_goes_on_a_cpu_node_and_with_gpus_needs_a_gpu_node():
    n = NodeView("a", memory_free=8 * GiB)
    assert why_not(Need("m", 3 * GiB, 0, VLLM), n) is None
    assert why_not(Need("m", 9 * GiB, 0, VLLM), n) == "needs 9 GiB, 8 GiB free"
    assert why_not(Need("m", 3 * GiB, 1, VLLM), n) == "needs 1 GPU, has 0"
    assert place(Need("m", 3 * GiB, 0, VLLM), [n]).node == "a"


def test_a_failed_engine_install_is_reported_with_its_reason():
    n = node("a", engine_state="failed: no space left on device")
    assert why_not(cpu(), n) == "llama.cpp 0.3.36 failed to install: no space left on device"


def test_a_node_that_fits_has_no_reason():
    assert why_not(cpu(), node("a")) is None
    assert why_not(cpu(), node("a", engine_state=None)) is None


def test_an_installed_engine_wins_over_installing_and_absent_even_with_less_memory():
    nodes = [node("absent", 64, None), node("installing", 32, "installing"), node("inst", 2)]
    assert place(cpu(), nodes) == place(cpu(), nodes[::-1])
    assert place(cpu(), nodes).node == "inst"
    assert place(cpu(), nodes).install is False
    p = place(cpu(), nodes[:2])
    assert (p.node, p.install) == ("installing", True)
    p = place(cpu(), nodes[:1])
    assert (p.node, p.install) == ("absent", True)


def test_a_node_without_the_model_wins_over_one_that_has_it_even_with_less_memory():
    nodes = [node("a", 64, replicas={"m": 1}), node("b", 4), node("c", 4, replicas={"x": 3})]
    assert place(cpu("m"), nodes).node == "b"


def test_when_every_node_has_the_model_the_fewest_replicas_win():
    nodes = [node("a", 64, replicas={"m": 2}), node("b", 4, replicas={"m": 1})]
    assert place(cpu("m"), nodes).node == "b"


def test_among_equals_the_most_free_memory_wins_then_the_node_id():
    assert place(cpu(), [node("a", 4), node("b", 6), node("c", 5)]).node == "b"
    assert place(cpu(), [node("b", 4), node("a", 4), node("c", 4)]).node == "a"


def test_nothing_fits_gives_every_nodes_reason():
    nodes = [node("a", lost=True), node("b", draining=True), node("c", 0.5)]
    p = place(cpu(gib=1), nodes)
    assert p.node is None
    assert p.reasons == {"a": "lost", "b": "draining", "c": "needs 1 GiB, 512 MiB free"}


def test_reasons_are_given_on_success_only_when_asked():
    nodes = [node("a", 8), node("b", 0.5)]
    assert place(cpu(), nodes).reasons == {}
    assert place(cpu(), nodes, explain=True).reasons == {"b": "needs 1 GiB, 512 MiB free"}


def test_a_pass_subtracts_each_choice_before_the_next():
    nodes = [node("a", 3), node("b", 2)]
    got = place_many([cpu("x", 2), cpu("y", 2), cpu("z", 2)], nodes)
    assert [p.node for p in got] == ["a", "b", None]
    assert got[2].reasons == {"a": "needs 2 GiB, 1 GiB free", "b": "needs 2 GiB, 0 MiB free"}
    assert nodes[0].memory_free == 3 * GiB  # the views passed in are left alone


def test_replicas_of_one_model_in_a_pass_spread_over_the_nodes():
    nodes = [node("a", 64), node("b", 8), node("c", 8)]
    got = place_many([cpu("m")] * 4, nodes)
    assert [p.node for p in got] == ["a", "b", "c", "a"]


def test_gpu_needs_go_where_enough_gpus_have_the_memory():
    nodes = [
        NodeView("cpu", memory_free=500 * GiB),
        NodeView("small", gpus=gpus_of(*(24 * GiB,) * 4)),
        NodeView("big", gpus=gpus_of(80 * GiB, 80 * GiB)),
    ]
    assert place(Need("m", 40 * GiB, 2, VLLM), nodes).node == "big"
    assert place(Need("m", 20 * GiB, 4, VLLM), nodes).node == "small"
    p = place(Need("m", 40 * GiB, 4, VLLM), nodes)
    assert p.node is None
    assert p.reasons == {
        "cpu": "needs 4 GPUs, has 0",
        "small": "needs 4 GPUs with 40 GiB free, has 0",
        "big": "needs 4 GPUs, has 2",
    }


def test_a_gpu_replica_takes_its_gpus_out_of_the_pass():
    nodes = [NodeView("g", gpus=gpus_of(80 * GiB, 30 * GiB, 30 * GiB))]
    got = place_many([Need(m, 25 * GiB, 1, VLLM) for m in "abcd"], nodes)
    # The smallest GPUs that fit go first, so the 80 GiB one stays for a big model.
    assert [p.node for p in got] == ["g", "g", "g", None]
    fleet = Fleet(nodes)
    fleet.take(Need("a", 25 * GiB, 1, VLLM), "g")
    assert fleet.place(Need("big", 70 * GiB, 1, VLLM)).node == "g"


def test_the_same_views_always_give_the_same_placements():
    rng = random.Random(7)
    nodes = [
        node(f"n{i}", rng.choice([2, 4, 8]), rng.choice(["installed", "installing", None]),
             replicas={f"m{rng.randrange(5)}": 1})
        for i in range(50)
    ]  # fmt: skip
    needs = [cpu(f"m{rng.randrange(5)}", rng.choice([1, 2, 3])) for _ in range(150)]
    first = place_many(needs, nodes)
    assert place_many(needs, nodes[::-1]) == first
    assert any(p.node is None for p in first) and any(p.node for p in first)


def test_place_many_agrees_with_a_plain_scan_of_every_node():
    rng = random.Random(3)
    nodes = [
        node(f"n{i:02}", rng.choice([1, 2, 3, 4]), rng.choice(["installed", "installing", None]))
        for i in range(30)
    ]
    needs = [cpu(f"m{rng.randrange(4)}", rng.choice([0.5, 1])) for _ in range(60)]
    memory = {n.id: n.memory_free for n in nodes}
    counts: dict[tuple[str, str], int] = {}
    tier = {"installed": 0, "installing": 1, None: 2}
    for need, got in zip(needs, place_many(needs, nodes), strict=True):
        fits = [n for n in nodes if memory[n.id] >= need.memory]

        def rank(n, need=need):
            spread = counts.get((need.model, n.id), 0)
            return tier[n.engines.get(LLAMA)], spread, -memory[n.id], n.id

        best = min(fits, default=None, key=rank)
        assert got.node == (best.id if best else None)
        if best:
            memory[best.id] -= need.memory
            counts[(need.model, best.id)] = counts.get((need.model, best.id), 0) + 1


def test_the_reasons_of_a_pass_match_why_not_for_each_node():
    rng = random.Random(11)
    nodes = [
        NodeView(f"n{i}", lost=rng.random() < 0.1, draining=rng.random() < 0.1,
                 memory_free=rng.choice([0, GiB // 2, GiB, 3 * GiB]),
                 gpus=gpus_of(*rng.choice([(), (40 * GiB,), (80 * GiB, 20 * GiB)])),
                 engines=rng.choice([{}, {LLAMA: "installed"}, {LLAMA: "failed: oops"},
                                     {VLLM: "installing"}]))
        for i in range(60)
    ]  # fmt: skip
    for need in [cpu(gib=4), cpu(gib=1), Need("m", 90 * GiB, 1, VLLM), Need("m", GiB, 2, VLLM)]:
        want = {n.id: why_not(need, n) for n in nodes}
        got = place(need, nodes, explain=True)
        assert got.reasons == {k: v for k, v in want.items() if v is not None}
        assert (got.node is None) == all(want.values())


def test_a_mixed_pass_over_several_engines_agrees_with_a_plain_scan_of_every_node():
    # Bookings move a node in every engine's index, for CPU and GPU needs alike: this
    # checks the indexes against a scan of every node with why_not after each booking.
    rng = random.Random(5)
    engines = [LLAMA, "llama.cpp-0.4.0", VLLM]
    nodes = [
        NodeView(f"n{i:02}", draining=rng.random() < 0.05, memory_free=rng.randrange(0, 9) * GiB,
                 gpus=gpus_of(*rng.choice([(), (), (24 * GiB, 80 * GiB), (40 * GiB,) * 4])),
                 engines={e: s for e in engines
                          if (s := rng.choice(["installed", "installing", None])) is not None})
        for i in range(40)
    ]  # fmt: skip
    needs = []
    for _ in range(150):
        if rng.random() < 0.3:
            needs.append(Need(f"g{rng.randrange(4)}", rng.choice([20, 40]) * GiB,
                              rng.choice([1, 2]), VLLM))  # fmt: skip
        else:
            gib = rng.choice([0.5, 1, 2])
            needs.append(cpu(f"m{rng.randrange(6)}", gib, engine=rng.choice(engines[:2])))
    memory = {n.id: n.memory_free for n in nodes}
    gpus = {n.id: sorted(g.free for g in n.gpus) for n in nodes}
    counts: dict[tuple[str, str], int] = {}
    tier = {"installed": 0, "installing": 1, None: 2}
    placed = 0
    for need, got in zip(needs, place_many(needs, nodes), strict=True):
        k = gpus_needed(need)

        def free(n, k=k):
            if k == 0:
                return memory[n.id]
            g = sorted(gpus[n.id], reverse=True)
            return g[k - 1] if len(g) >= k else -1

        def booked(n):
            return NodeView(n.id, n.lost, n.draining, memory[n.id], gpus_of(*gpus[n.id]), n.engines)

        fits = [n for n in nodes if why_not(need, booked(n)) is None]
        best = min(
            fits,
            default=None,
            key=lambda n: (tier[n.engines.get(need.engine)], counts.get((need.model, n.id), 0),
                           -free(n), n.id),
        )  # fmt: skip
        assert got.node == (best.id if best else None), need
        if best is None:
            continue
        placed += 1
        counts[(need.model, best.id)] = counts.get((need.model, best.id), 0) + 1
        if k == 0:
            memory[best.id] -= need.memory
        else:
            fit = [i for i, g in enumerate(gpus[best.id]) if g >= need.memory][:k]
            gpus[best.id] = [g for i, g in enumerate(gpus[best.id]) if i not in fit]
    assert 30 < placed < len(needs)


def test_a_node_without_disk_for_the_weights_is_passed_over_with_the_reason():
    need = Need("m", GiB, 0, LLAMA, disk=4 * GiB, weights="c1")
    small, big = node("a", gib=16, disk_free=GiB), node("b", gib=2, disk_free=100 * GiB)
    p = place(need, [small, big], explain=True)
    assert p.node == "b"
    assert p.reasons["a"] == "needs 4 GiB of disk for its weights, 1 GiB free"
    nowhere = place(need, [small])
    assert nowhere.node is None
    assert nowhere.reasons["a"] == "needs 4 GiB of disk for its weights, 1 GiB free"


def test_a_node_that_has_the_weights_or_says_nothing_of_its_disk_needs_no_room():
    need = Need("m", GiB, 0, LLAMA, disk=4 * GiB, weights="c1")
    assert place(need, [node("a", disk_free=GiB, weights=frozenset({"c1"}))]).node == "a"
    assert place(need, [node("a")]).node == "a"  # an agent that does not report disk
    assert why_not(need, node("a", disk_free=GiB, weights=frozenset({"c2"}))) is not None


def test_disk_counts_when_every_fitting_node_already_has_a_replica():
    need = Need("m", GiB, 0, LLAMA, disk=4 * GiB, weights="c1")
    fleet = Fleet([node("a", gib=16, disk_free=GiB, replicas={"m": 1}),
                   node("b", gib=4, disk_free=50 * GiB, replicas={"m": 2})])  # fmt: skip
    assert fleet.place(need).node == "b"


def test_a_pass_holds_the_cycle_collector_off_and_gives_it_back_as_it_found_it():
    import gc

    seen = []

    class Engines(dict):
        def get(self, *args):  # read while the pass indexes the node
            seen.append(gc.isenabled())
            return super().get(*args)

    assert gc.isenabled()
    place_many([cpu()], [node("n1", engines=Engines({LLAMA: "installed"}))])
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        place_many([cpu()], [node("n1")])
        assert not gc.isenabled()
    finally:
        gc.enable()
