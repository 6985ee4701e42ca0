"""LoRA adapters as models: the catalog's checks, where the scheduler loads a wanted
adapter (least recently used out), what the routing table and `llmgw models` say, and
the router sending an adapter's requests only to a replica that has it loaded."""

import json
from pathlib import Path

import pytest

from llmgw import catalog, config
from llmgw.engines import ALONE, Launch
from llmgw.engines.vllm import ENGINE as VLLM
from llmgw.errors import ConfigError
from llmgw_router.routing import RoutingTable
from llmgw_scheduler.adapters import Holding, choose, trim
from llmgw_scheduler.admin import View
from tests.fake_fleet import Fleet, GiB
from tests.unit.test_feed import feed_for, routes

BASE = {"name": "base", "source": "/models/base", "engine": "vllm",
        "profile": {"memory_bytes": GiB, "max_adapters": 2}}  # fmt: skip


def adapter(name: str = "tuned", **kw) -> dict:
    return {"name": name, "source": f"/adapters/{name}", "adapter_of": "base", **kw}


def load(*tables) -> list[catalog.Model]:
    return catalog.load([config.model_from(t) for t in tables])


# -- the catalog ---------------------------------------------------------------------------


def test_an_adapter_is_a_model_on_its_base_s_engine_and_profile_with_prices_of_its_own():
    base, a = load(BASE, adapter(aliases=["t"], pricing={"input_per_mtok": 2.0}))
    assert (a.adapter_of, a.engine_id, a.context, a.aliases) == ("base", base.engine_id,
                                                                base.context, ("t",))  # fmt: skip
    assert (a.min, a.max, a.max_adapters, a.input_per_mtok) == (0, 0, 0, 2.0)
    assert base.max_adapters == 2 and a.to_json()["adapter_of"] == "base"


LLAMA = {"name": "llama", "source": "/models/l.gguf"}


@pytest.mark.parametrize(
    "tables,field,says",
    [
        ([BASE, adapter(adapter_of="nothing")], "adapter_of", "unknown model 'nothing'"),
        ([LLAMA, adapter(adapter_of="llama")], "adapter_of", "cannot load adapters"),
        (
            [{**BASE, "profile": {"memory_bytes": GiB}}, adapter()],
            "adapter_of",
            "profile.max_adapters is 0",
        ),
        ([BASE, adapter("a"), adapter("b", adapter_of="a")], "adapter_of", "itself an adapter"),
        ([BASE, adapter(profile={"context": 2048})], "profile", "must not be set"),
        ([BASE, adapter(scaling={"min": 0})], "scaling", "must not be set"),
        ([BASE, adapter(engine_version="0.1")], "engine_version", "must not be set"),
        ([BASE, adapter(engine="sglang")], "engine", "its base's"),
        ([BASE, adapter(source="pypi:some-adapter")], "source", "PEFT directory"),
        ([BASE, adapter(source="hf://org/repo/adapter.safetensors")], "source", "PEFT"),
        ([{**LLAMA, "profile": {"max_adapters": 1}}], "profile.max_adapters", "vllm"),
        ([{**BASE, "profile": {"max_adapters": -1}}], "profile.max_adapters", "negative"),
    ],
)
def test_an_adapter_that_cannot_work_is_refused_in_one_line_naming_model_and_field(
    tables, field, says
):
    with pytest.raises(ConfigError) as err:
        load(*tables)
    text = str(err.value)
    assert f": {field} " in text and says in text and "\n" not in text, text
    assert text.startswith("model '")


def test_vllm_takes_runtime_lora_updates_only_where_the_profile_asks_for_adapters():
    launch = Launch("/w/m", "127.0.0.1", 8101, "", 2048, 2, key="k", max_adapters=3)
    cmd = VLLM.command(ALONE, Path("/e/v"), launch)
    assert cmd.argv[cmd.argv.index("--max-loras") + 1] == "3" and "--enable-lora" in cmd.argv
    assert cmd.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = VLLM.command(ALONE, Path("/e/v"), Launch("/w/m", "h", 1, "", 2048, 2))
    assert "--enable-lora" not in plain.argv
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env


# -- the choice, pure ----------------------------------------------------------------------


def test_an_adapter_goes_to_the_replica_that_holds_it_else_the_one_with_most_room():
    held = [Holding("r-1", ("a",)), Holding("r-2", ())]
    assert choose("a", held, 2, {}) == ("r-1", "")
    assert choose("b", held, 2, {}) == ("r-2", "")
    assert choose("b", [], 2, {}) is None


def test_on_full_replicas_the_least_recently_used_adapter_of_all_is_unloaded():
    held = [Holding("r-1", ("a", "b")), Holding("r-2", ("c", "d"))]
    used = {"a": 50.0, "b": 40.0, "c": 30.0, "d": 60.0}
    assert choose("e", held, 2, used) == ("r-2", "c")
    used["c"] = 70.0
    assert choose("e", held, 2, used) == ("r-1", "b")


def test_a_replica_over_its_bound_keeps_its_most_recently_used_adapters():
    assert trim(["a", "b", "c"], 2, {"a": 3.0, "b": 1.0, "c": 2.0}) == ["a", "c"]
    assert trim(["a"], 2, {}) == ["a"]


# -- the scheduler -------------------------------------------------------------------------


@pytest.fixture
def fleet(tmp_path):
    base = {**BASE, "scaling": {"min": 2, "max": 2},
            "profile": {"memory_bytes": GiB, "max_adapters": 1}}  # fmt: skip
    f = Fleet(tmp_path, [config.model_from(t) for t in (base, *map(adapter, "abc"))])
    for node in ("n1", "n2"):
        f._say(node, "hello", {
            "resources": {"cpus": 4, "memory_total": 16 * GiB, "memory_available": 8 * GiB,
                          "gpus": []},
            "engines": {"vllm-0.32.0": {"state": "installed", "reason": ""}}, "shards": [],
        })  # fmt: skip
    for _ in range(2):  # one start a pass
        f.tick()
        for node, body in f.sent("start_shard"):
            f.shard(node, body["id"], "ready")
    assert len(f.sched.inv.replicas) == 2
    yield f
    f.close()


def want(fleet, name: str, n: int = 1) -> None:
    fleet._say("router", "want", {"model": name, "n": n})


def loaded(fleet, node: str, rid: str, *names: str) -> None:
    fleet.shard(node, rid, "ready", adapters=list(names))


def served(fleet) -> dict[str, list[str]]:
    """Replica id -> the adapters the routing table sends there."""
    return {r["id"]: [a["name"] for a in r.get("adapters", ())]
            for r in fleet.sched.routes()["replicas"]}  # fmt: skip


def test_a_wanted_adapter_is_loaded_on_a_replica_and_routed_there_once_loaded(fleet):
    want(fleet, "a", 3)
    fleet.tick()
    ((node, body),) = fleet.sent("set_adapters")
    assert [s["name"] for s in body["adapters"]] == ["a"]
    assert body["adapters"][0]["source"] == "/adapters/a"
    entry = next(m for m in fleet.sched.routes()["models"] if m["name"] == "a")
    assert entry["state"] == "starting" and entry["answered"] == {"router": 3}
    assert all(not names for names in served(fleet).values())  # not loaded yet
    loaded(fleet, node, body["id"], "a")
    assert served(fleet)[body["id"]] == ["a"]
    (row,) = [m for m in View(fleet.sched).models() if m["name"] == "a"]
    assert row["loaded_on"] == [{"replica": body["id"], "node": node}]
    assert row["state"] == "serving" and row["adapter_of"] == "base"


def test_with_one_adapter_a_replica_a_second_goes_where_there_is_room_then_evicts(fleet):
    want(fleet, "a")
    fleet.tick()
    ((node_a, first),) = fleet.sent("set_adapters")
    loaded(fleet, node_a, first["id"], "a")
    want(fleet, "b")
    fleet.tick()
    ((node_b, second),) = fleet.sent("set_adapters")
    assert second["id"] != first["id"]  # the other replica had room
    loaded(fleet, node_b, second["id"], "b")
    fleet.activity("router", {"idle_s": {"a": 100.0, "b": 1.0}})  # a used longest ago
    want(fleet, "c")
    fleet.tick()
    ((node, third),) = fleet.sent("set_adapters")
    assert (node, third["id"]) == (node_a, first["id"])
    assert [s["name"] for s in third["adapters"]] == ["c"]  # a is unloaded for it
    assert served(fleet)[first["id"]] == []  # a is no longer routed there, at once


def test_a_set_the_agent_has_not_applied_is_sent_again_but_not_on_every_pass(fleet):
    want(fleet, "a")
    fleet.tick()
    assert len(fleet.sent("set_adapters")) == 1
    fleet.tick(1.0)
    assert fleet.sent("set_adapters") == []
    fleet.tick(5.0)
    assert len(fleet.sent("set_adapters")) == 1


def test_a_new_leader_learns_each_replica_s_adapters_from_its_agent(fleet):
    rid, r = next(iter(fleet.sched.inv.replicas.items()))
    loaded(fleet, r.node, rid, "b")
    fleet.sched.adapters.given.clear()  # as a scheduler that has just taken over
    fleet.tick()
    assert served(fleet)[rid] == ["b"] and fleet.sent("set_adapters") == []


# -- the router ----------------------------------------------------------------------------


def test_the_router_sends_an_adapter_only_to_a_replica_that_has_it_loaded():
    table = RoutingTable()
    rep = {"model": "base", "aliases": [], "key": "k", "state": "ready", "engine": "vllm"}
    feed_for(table).handle(routes(1, [
        {**rep, "id": "r-1", "endpoint": "http://10.0.0.1:1"},
        {**rep, "id": "r-2", "endpoint": "http://10.0.0.2:1",
         "adapters": [{"name": "a", "aliases": ["a-alias"]}]},
    ]))  # fmt: skip
    for _ in range(4):  # ties rotate: without the filter r-1 would come up
        assert table.pick("a", 0.0).id == "r-2"
        assert table.pick("a-alias", 0.0).id == "r-2"
    assert {table.pick("base", 0.0).id for _ in range(4)} == {"r-1", "r-2"}
    assert json.dumps(sorted(table.models())) == '["a", "a-alias", "base"]'
