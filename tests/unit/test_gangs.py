"""Gang placement: a replica across nodes is placed whole or not at all, on one fabric."""

import hashlib
import json

import pytest

from llmgw import catalog
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.errors import ConfigError
from llmgw.gangs import AUTO, GangFleet, split
from llmgw.placement import MiB, Need, NodeView

LLAMA = "llama.cpp-0.3.36"
NEED = Need("big", 342 * MiB, 0, LLAMA)


def node(i, free_mib=200, **kw) -> NodeView:
    return NodeView(f"n{i}", memory_free=free_mib * MiB, engines={LLAMA: "installed"}, **kw)


def fleet(nodes, fabric="lan", addresses=None) -> GangFleet:
    fabrics = {n.id: (fabric, f"10.0.0.{i}") for i, n in enumerate(nodes)}
    fabrics.update(addresses or {})
    return GangFleet(nodes, fabrics)


def test_a_model_that_fits_no_node_alone_is_split_over_two_with_parts_that_fit():
    nodes = [node(1), node(2), node(3, free_mib=150)]
    gang = fleet(nodes).place(NEED, AUTO)
    assert [s.node for s in gang.shards] == ["n1", "n2"]
    assert sum(s.memory for s in gang.shards) == NEED.memory
    assert all(s.memory <= 200 * MiB for s in gang.shards)
    assert gang.leader == "n1"
    assert gang.tensor_split() == [0.5, 0.5]


def test_parts_follow_free_memory_so_a_big_node_takes_a_big_part():
    nodes = [node(1, free_mib=300), node(2, free_mib=100)]
    gang = fleet(nodes).place(NEED, 2)
    assert [s.memory for s in gang.shards] == split(NEED.memory, [300 * MiB, 100 * MiB])
    assert gang.shards[0].memory == pytest.approx(0.75 * NEED.memory, abs=1)
    assert gang.tensor_split() == [0.75, 0.25]


def test_a_gang_is_placed_whole_or_not_at_all_and_each_node_says_why():
    nodes = [node(1, free_mib=150), node(2, free_mib=150)]
    gang = fleet(nodes).place(NEED, AUTO)
    assert not gang.placed
    assert "fabric 'lan'" in gang.reasons
    assert "needs 342 MiB" in gang.reasons["fabric 'lan'"]
    assert "300 MiB free on 2" in gang.reasons["fabric 'lan'"]
    assert gang.reasons["n1"].startswith("150 MiB free;")


def test_nodes_on_different_fabrics_are_never_in_one_gang():
    nodes = [node(1), node(2)]
    gang = GangFleet(nodes, {"n1": ("rack-a", "10.0.0.1"), "n2": ("rack-b", "10.0.1.2")}).place(
        NEED, AUTO
    )
    assert not gang.placed
    assert set(gang.reasons) >= {"fabric 'rack-a'", "fabric 'rack-b'"}


def test_a_node_without_a_fabric_address_lost_or_draining_takes_no_shard():
    nodes = [node(1), node(2, lost=True), node(3, draining=True), node(4, 100), node(5)]
    gang = fleet(nodes, addresses={"n5": ("lan", "")}).place(NEED, AUTO)
    assert not gang.placed
    assert gang.reasons["n2"] == "lost"
    assert gang.reasons["n3"] == "draining"
    assert "agent.fabric_address" in gang.reasons["n5"]
    gang = fleet([node(1), node(4)]).place(NEED, AUTO)
    assert [s.node for s in gang.shards] == ["n1", "n4"]


def test_an_engine_that_failed_to_install_rules_a_node_out_and_an_absent_one_installs_first():
    nodes = [node(1), node(2), node(3)]
    nodes[0].engines = {LLAMA: "failed: no compiler"}
    nodes[1].engines = {}
    gang = fleet(nodes).place(NEED, AUTO)
    assert {s.node: s.install for s in gang.shards} == {"n2": True, "n3": False}
    assert "failed" in fleet(nodes).place(NEED, 3).reasons["n1"]


def test_exactly_the_nodes_asked_for_even_when_fewer_would_do():
    nodes = [node(i, free_mib=400) for i in range(1, 5)]
    gang = fleet(nodes).place(NEED, 3)
    assert len(gang.shards) == 3
    assert fleet(nodes[:2]).place(NEED, 3).reasons["fabric 'lan'"] == "needs 3 nodes, has 2 usable"


def test_the_fabric_needing_fewest_nodes_wins():
    nodes = [node(1), node(2), node(3, free_mib=400), node(4, free_mib=400)]
    fabrics = {"n1": ("a", "10.0.0.1"), "n2": ("a", "10.0.0.2"),
               "n3": ("b", "10.0.1.3"), "n4": ("b", "10.0.1.4")}  # fmt: skip
    gang = GangFleet(nodes, fabrics).place(NEED, AUTO)
    assert gang.fabric == "b"
    assert len(gang.shards) == 2  # auto takes two at least: a gang of one is no gang


def test_a_pass_books_what_it_placed_so_two_gangs_never_share_the_same_memory():
    nodes = [node(i) for i in range(1, 5)]
    f = fleet(nodes)
    first = f.place(NEED, AUTO)
    f.take(NEED, first)
    second = f.place(NEED, AUTO)
    assert second.placed
    assert {s.node for s in first.shards}.isdisjoint(s.node for s in second.shards)
    f.take(NEED, second)
    assert not f.place(NEED, AUTO).placed


def test_the_same_views_give_the_same_answer():
    nodes = [node(i) for i in range(1, 6)]
    assert fleet(nodes).place(NEED, AUTO) == fleet(list(reversed(nodes))).place(NEED, AUTO)


def test_split_adds_up_exactly():
    parts = split(1000, [3, 3, 3])
    assert sum(parts) == 1000
    assert max(parts) - min(parts) <= 1


@pytest.mark.parametrize(
    "profile, field, words",
    [
        ({"nodes": 0}, "profile.nodes", '1-64 or "auto"'),
        ({"nodes": 65}, "profile.nodes", '1-64 or "auto"'),
        ({"nodes": "two"}, "profile.nodes", '1-64 or "auto"'),
        ({"nodes": 2, "gpus": 1}, "profile.nodes must be 1 with profile.gpus", "CPUs only"),
        ({"tensor_parallel": 2}, "profile.tensor_parallel", "vllm engine only"),
    ],
)
def test_a_split_definition_that_cannot_work_is_refused_naming_the_field(profile, field, words):
    m = ModelConfig(name="big", source="/m.gguf", profile=ProfileConfig(**profile))
    with pytest.raises(ConfigError) as e:
        catalog.load([m])
    assert field in str(e.value)
    assert words in str(e.value)


def test_vllm_across_gpu_nodes_is_refused_until_gangs_book_gpus():
    m = ModelConfig(name="big", source="/m.gguf", engine="vllm", engine_version="0.9.2",
                    profile=ProfileConfig(gpus=2, nodes=2))  # fmt: skip
    with pytest.raises(ConfigError, match="profile.nodes must be 1 with profile.gpus"):
        catalog.load([m])
    m.profile = ProfileConfig(gpus=2, tensor_parallel=4)
    with pytest.raises(
        ConfigError, match=r"profile.tensor_parallel must be at most profile.gpus \(2\)"
    ):
        catalog.load([m])


def test_a_split_profile_is_a_new_profile_and_a_one_node_profile_keeps_its_hash():
    one = catalog.load([ModelConfig(name="m", source="/m.gguf")])[0]
    auto = catalog.load([ModelConfig(name="m", source="/m.gguf",
                                     profile=ProfileConfig(nodes="auto"))])[0]  # fmt: skip
    assert (one.nodes, one.split, auto.nodes, auto.split) == (1, False, AUTO, True)
    assert one.profile_hash() != auto.profile_hash()
    # As before profile.nodes existed: upgrading restarts no running replica.
    before = [one.source, one.sha256, one.engine_id, one.context, one.parallel, one.gpus, []]
    assert one.profile_hash() == hashlib.sha256(json.dumps(before).encode()).hexdigest()[:16]
    assert auto.to_json()["nodes"] == "auto"
