"""A third engine is one module (tests/third_engine.py) and a registration: the catalog
takes a model on it, placement places it, the agent builds its command, starts it and
drains it by its load signal, the router's prober reads that signal, and the router
translates what it does not serve — with no other file changed."""

import time

import pytest
import requests

from llmgw import catalog, engines
from llmgw.config import AgentConfig, ModelConfig, ProfileConfig
from llmgw.engines import Launch
from llmgw.errors import ConfigError
from llmgw.placement import GiB, Need, NodeView, gpus_of, place
from llmgw_agentd import counters, supervisor
from llmgw_agentd.engines import Installer
from llmgw_agentd.weights import Weights
from llmgw_router.probe import Probe
from llmgw_router.routing import Endpoint, RoutingTable
from tests import third_engine
from tests.helpers import eventually, free_range


@pytest.fixture
def third():
    engine = third_engine.register()
    yield engine
    third_engine.unregister()


def model(**profile) -> ModelConfig:
    return ModelConfig(name="m3", source="/w/m.gguf", engine="third",
                       profile=ProfileConfig(**profile))  # fmt: skip


def test_the_catalog_and_placement_take_a_model_on_a_registered_third_engine(third):
    (m,) = catalog.load([model(gpus=1)])
    assert m.engine_id == "third-1"  # its own pinned version
    with pytest.raises(ConfigError, match="profile.gpus must be at least 1 for the third"):
        catalog.load([model()])
    with pytest.raises(ConfigError, match="profile.nodes must be 1 for third"):
        catalog.load([model(gpus=1, nodes=2)])
    need = Need("m3", GiB, 0, m.engine_id)  # its GPU is the engine's word, not the profile's
    cpu = NodeView("cpu", memory_free=8 * GiB)
    gpu = NodeView("gpu", memory_free=8 * GiB, gpus=gpus_of(4 * GiB))
    assert place(need, [cpu, gpu]).node == "gpu"
    assert place(need, [cpu]).reasons["cpu"] == "needs 1 GPU, has 0"


def test_unregistered_the_third_engine_is_unknown_to_the_catalog():
    with pytest.raises(ConfigError, match="'third' is not known"):
        catalog.load([model(gpus=1)])


def started(tmp_path, third, drain_timeout_s: float = 30.0):
    low, high = free_range(4)
    cfg = AgentConfig(port_min=low, port_max=high, drain_timeout_s=drain_timeout_s)
    weights_file = tmp_path / "m.gguf"
    weights_file.write_bytes(b"GGUF")
    states: list[dict] = []
    installer = Installer(cfg, tmp_path, lambda: True, lambda *a: None)
    sup = supervisor.Supervisor(cfg, tmp_path, installer, Weights(tmp_path), states.append)
    sup.start({"id": "r-3", "model": "m3", "engine": "third", "engine_version": "1",
               "source": str(weights_file), "key": "k3", "gpus": 1})  # fmt: skip
    eventually(lambda: any(s["state"] == "ready" for s in states), 20, what="ready")
    return sup, states


def control(shard, **body) -> None:
    requests.post(shard.endpoint + "/_control", json=body, timeout=5).raise_for_status()


def load_reads(shard) -> int:
    return requests.get(shard.endpoint + "/_stats", timeout=5).json()["load_reads"]


def test_the_agent_builds_its_command_and_the_router_reads_its_load(tmp_path, third):
    installer = Installer(AgentConfig(), tmp_path, lambda: True, lambda *a: None)
    assert installer.is_installed("third", "1")  # PROVIDED: nothing to install
    cmd = installer.command("third", "1", Launch("/w/m", "127.0.0.1", 8123, "/k", 512, 1))
    assert cmd.argv[1:3] == [str(third_engine.FAKE_ENGINE), "--host"] and "8123" in cmd.argv
    assert installer.health("third", "1") == "/health"
    sup, _ = started(tmp_path, third)
    shard = sup.shards["r-3"]
    try:
        control(shard, extra_busy=3)
        ep = Endpoint("r-3", shard.endpoint, ("m3",), key="k3", engine="third")
        Probe(RoutingTable([ep]), 1.0).probe(ep, time.time())
        assert (ep.signal.busy, ep.signal.waiting) == (3, 0)
        assert not engines.serves("third", engines.MESSAGES)  # Messages go as chat
        text = "# TYPE third:prompt_total counter\nthird:prompt_total 9\nthird:out_total 2\n"
        assert counters.parse(text, "third") == {"prompt": 9, "cached": None, "generated": 2}
    finally:
        control(shard, extra_busy=0)
        sup.stop("r-3")
        eventually(lambda: sup.shards["r-3"].done, 20, what="stopped")


def test_a_draining_engine_is_stopped_only_once_its_running_request_ends(tmp_path, third):
    sup, states = started(tmp_path, third)
    shard = sup.shards["r-3"]
    control(shard, extra_busy=1)  # one request running, as the engine says
    sup.stop("r-3")
    eventually(lambda: load_reads(shard) >= 5, 20, what="the drain asking the engine")
    assert shard.proc.poll() is None and not shard.done  # no SIGTERM while it runs
    assert [s["state"] for s in states][-1] == "draining"
    control(shard, extra_busy=0)
    eventually(lambda: shard.done, 20, what="stopped once idle")
    assert shard.proc.poll() is not None and states[-1]["state"] == "stopped"


def test_a_drain_ends_with_the_grace_period_though_the_request_still_runs(tmp_path, third):
    sup, states = started(tmp_path, third, drain_timeout_s=1.0)
    shard = sup.shards["r-3"]
    control(shard, extra_busy=1)
    t0 = time.monotonic()
    sup.stop("r-3")
    eventually(lambda: shard.done, 20, what="stopped at the end of the grace period")
    assert time.monotonic() - t0 >= 1.0 and states[-1]["state"] == "stopped"
    assert shard.proc.poll() is not None
