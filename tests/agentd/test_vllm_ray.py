"""A vLLM replica across nodes on Ray, checked as data; Ray installed beside vLLM."""

from pathlib import Path

import pytest

from llmgw.config import AgentConfig
from llmgw_agentd import vllm_ray
from llmgw_agentd.engines import RAY_REQUIREMENT, Installer, Launch
from llmgw_agentd.errors import EngineError
from llmgw_agentd.vllm_ray import HEAD, SERVE, WORKER, Member, plan

VENV = Path("/var/lib/llmgw/engines/vllm-0.9.2")
LAUNCH = Launch(model_path="/w/llama-70b", host="10.1.0.11", port=8100, key_file="/s/r.key",
                context=8192, parallel=16, served_name="llama-70b")  # fmt: skip
LEADER = Member("gpu-a", "192.168.50.11", "ib0", (8150, 8179), (0, 1))
WORKER_NODE = Member("gpu-b", "192.168.50.12", "ib0", (8120, 8149), (2, 3))


def two_by_two() -> list[vllm_ray.Step]:
    return plan(VENV, LAUNCH, [LEADER, WORKER_NODE], 2, 2, key="sk-engine")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_two_node_tp2_pp2_replica_is_a_ray_head_a_ray_worker_and_one_server():
    head, worker, serve = two_by_two()
    assert (head.node, head.role) == ("gpu-a", HEAD)
    assert (worker.node, worker.role) == ("gpu-b", WORKER)
    assert (serve.node, serve.role) == ("gpu-a", SERVE)
    assert head.argv[:3] == [str(VENV / "bin" / "ray"), "start", "--head"]
    assert flag(head.argv, "--port") == "8150"
    assert worker.argv[:4] == [str(VENV / "bin" / "ray"), "start", "--address",
                               "192.168.50.11:8150"]  # fmt: skip
    assert worker.after == "tcp 192.168.50.11:8150 accepts"
    assert "4 GPUs on 2 nodes" in serve.after


def test_the_server_is_vllm_with_tensor_and_pipeline_parallelism_on_ray():
    serve = two_by_two()[-1]
    assert serve.argv[:3] == [str(VENV / "bin" / "python"), "-m",
                              "vllm.entrypoints.openai.api_server"]  # fmt: skip
    assert flag(serve.argv, "--tensor-parallel-size") == "2"
    assert flag(serve.argv, "--pipeline-parallel-size") == "2"
    assert flag(serve.argv, "--distributed-executor-backend") == "ray"
    assert flag(serve.argv, "--served-model-name") == "llama-70b"
    assert (flag(serve.argv, "--host"), flag(serve.argv, "--port")) == ("10.1.0.11", "8100")
    assert serve.env["RAY_ADDRESS"] == "192.168.50.11:8150"
    assert serve.env["VLLM_API_KEY"] == "sk-engine"
    assert "sk-engine" not in " ".join(serve.argv)


def test_nccl_gloo_and_vllm_are_pinned_to_each_nodes_fabric():
    head, worker, serve = two_by_two()
    for step, node in ((head, LEADER), (worker, WORKER_NODE), (serve, LEADER)):
        assert step.env["NCCL_SOCKET_IFNAME"] == "ib0"
        assert step.env["GLOO_SOCKET_IFNAME"] == "ib0"
        assert step.env["VLLM_HOST_IP"] == node.fabric_address
        assert step.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, node.gpus))
    assert flag(head.argv, "--node-ip-address") == "192.168.50.11"
    assert flag(worker.argv, "--node-ip-address") == "192.168.50.12"
    assert flag(head.argv, "--num-gpus") == flag(worker.argv, "--num-gpus") == "2"
    assert "VLLM_API_KEY" not in head.env and "VLLM_API_KEY" not in worker.env


def test_every_port_comes_from_that_nodes_block_of_its_range():
    head, worker, serve = two_by_two()
    ports_flags = ("--port", "--node-manager-port", "--object-manager-port",
                   "--ray-client-server-port", "--dashboard-agent-listen-port",
                   "--dashboard-agent-grpc-port", "--metrics-export-port",
                   "--runtime-env-agent-port", "--min-worker-port",
                   "--max-worker-port")  # fmt: skip
    for step, node in ((head, LEADER), (worker, WORKER_NODE)):
        used = [int(flag(step.argv, f)) for f in ports_flags if f in step.argv]
        assert used and all(node.ports[0] <= p <= node.ports[1] for p in used), used
        singles = used[:-2]  # all but the worker range
        assert len(set(singles)) == len(singles)
    assert flag(worker.argv, "--min-worker-port") == "8129"
    assert flag(worker.argv, "--max-worker-port") == "8149"
    assert serve.env["VLLM_PORT"] == "8158"  # the leader's dist-init port
    assert "--include-dashboard=false" in head.argv


@pytest.mark.parametrize(
    "members, tp, pp, says",
    [
        ([LEADER, WORKER_NODE], 2, 1, "needs 2 GPUs; the nodes give 4"),
        ([Member("gpu-a", "0.0.0.0", "ib0", (8150, 8179), (0, 1)), WORKER_NODE], 2, 2,
         "node gpu-a: agent.fabric_address"),
        ([LEADER, Member("gpu-b", "192.168.50.12", "", (8120, 8149), (2, 3))], 2, 2,
         "node gpu-b: agent.fabric_interface"),
        ([LEADER, Member("gpu-b", "192.168.50.12", "ib0", (8120, 8129), (2, 3))], 2, 2,
         "node gpu-b: ports 8120-8129 are 10; Ray and vLLM need 19"),
        ([], 1, 1, "at least one node"),
    ],
)  # fmt: skip
def test_a_plan_that_cannot_work_is_refused_naming_the_node_and_setting(members, tp, pp, says):
    with pytest.raises(EngineError, match=says):
        plan(VENV, LAUNCH, members, tp, pp)


def test_vllm_is_installed_with_ray_in_its_own_environment(tmp_path, monkeypatch):
    steps = []

    def run(self, argv, log_file, what, engine_id):
        steps.append(argv)
        if what == "pip install":
            venv = Path(argv[0]).parent.parent
            (venv / "bin").mkdir(parents=True, exist_ok=True)
            (venv / "bin" / "ray").write_text("#!/bin/sh\n")

    monkeypatch.setattr(Installer, "_run", run)
    installer = Installer(AgentConfig(), tmp_path, lambda: True, lambda *a: None)
    installer.ensure("vllm", "0.9.2")
    pip = next(s for s in steps if s[1:2] == ["install"])
    assert pip[2:] == ["vllm==0.9.2", RAY_REQUIREMENT]
    assert installer.is_installed("vllm", "0.9.2")


def test_an_older_vllm_install_without_ray_is_not_counted_as_installed(tmp_path):
    venv = tmp_path / "engines" / "vllm-0.9.2"
    venv.mkdir(parents=True)
    (venv / ".installed").write_text("0.9.2\n")
    installer = Installer(AgentConfig(), tmp_path, lambda: True, lambda *a: None)
    assert not installer.is_installed("vllm", "0.9.2")
