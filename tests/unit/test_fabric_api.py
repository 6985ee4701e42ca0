"""Which pairs `llmgw fabric test` measures, and what it refuses, without a bus."""

import threading

import pytest

from llmgw.errors import Invalid, NotFound
from llmgw_scheduler import fabric_api
from llmgw_scheduler.inventory import Node


class Sched:
    def __init__(self, nodes: dict[str, tuple[str, str]], lost: set[str] = frozenset()):
        self.lock = threading.Lock()
        self.inv = type("Inv", (), {})()
        self.inv.nodes = {
            name: Node(name, 0.0, lost=name in lost,
                       topology={"fabric": {"address": addr, "label": label}})
            for name, (addr, label) in nodes.items()
        }  # fmt: skip

    def connected(self, node: str) -> None:
        if node not in self.inv.nodes or self.inv.nodes[node].lost:
            raise NotFound(f"node '{node}' is not connected")


@pytest.fixture
def measured(monkeypatch):
    pairs = []
    monkeypatch.setattr(fabric_api, "pair", lambda s, a, b, size: pairs.append((a, b)) or {})
    return pairs


def test_with_no_node_named_only_pairs_on_one_fabric_are_measured(measured):
    s = Sched({"a": ("10.0.0.1", "ib"), "b": ("10.0.0.2", "ib"), "c": ("10.1.0.1", "eth"),
               "d": ("", ""), "e": ("10.0.0.5", "ib")}, lost={"e"})  # fmt: skip
    body = fabric_api.run(s, [], 1)
    assert body["nodes"] == ["a", "b", "c"]
    assert measured == [("a", "b")]


def test_named_nodes_are_measured_pairwise_in_the_order_given(measured):
    s = Sched({"a": ("10.0.0.1", "ib"), "b": ("10.0.0.2", "ib"), "c": ("10.1.0.1", "eth")})
    fabric_api.run(s, ["c", "a", "b", "a"], 1)
    assert measured == [("c", "a"), ("c", "b"), ("a", "b")]


def test_fewer_than_two_nodes_on_a_fabric_is_refused_saying_what_is_missing(measured):
    s = Sched({"a": ("10.0.0.1", "ib"), "c": ("10.1.0.1", "eth")})
    with pytest.raises(Invalid, match="on the same agent.fabric"):
        fabric_api.run(s, [], 1)
    with pytest.raises(Invalid, match="needs two connected nodes"):
        fabric_api.run(s, ["a"], 1)
    with pytest.raises(NotFound, match="node 'zz' is not connected"):
        fabric_api.run(s, ["a", "zz"], 1)
    assert measured == []
