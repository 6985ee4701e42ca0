"""The agent reports the GPU interconnect, InfiniBand ports and GPU health: in its hello
to the scheduler and as Prometheus metrics; a node without GPUs reports none, quietly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from prometheus_client import REGISTRY

from llmgw import topology
from llmgw.config import AgentConfig
from llmgw_agentd import metrics
from llmgw_agentd.resources import Resources
from llmgw_agentd.topology import Probe, run_nvidia_smi
from tests import fake_smi as smi
from tests.agentd.conftest import NODE
from tests.helpers import Proc, eventually, free_port

FIX = Path(__file__).parent.parent / "fixtures" / "topology"


def fake_smi(box: str):
    calls = []

    def run(args: list[str]) -> str:
        calls.append(args)
        ext = "topo.txt" if args[:2] == ["topo", "-m"] else "health.csv"
        return (FIX / f"{box}.{ext}").read_text()

    run.calls = calls
    return run


def test_a_gpu_node_reports_its_matrix_ports_health_and_fabric():
    cfg = AgentConfig(fabric="ib-a", fabric_address="10.0.0.5", fabric_interface="ib0")
    probe = Probe(cfg, run=fake_smi("h100-sxm-8gpu"), ib_root=FIX / "infiniband" / "h100-sxm-8gpu")
    report = probe.report()
    matrix = topology.Topology.from_dict(report["matrix"])
    assert matrix.link(0, 7) == "NV18"
    assert [p["device"] for p in report["infiniband"] if p["state"] != "ACTIVE"] == ["mlx5_3"]
    assert report["health"][5]["ecc_uncorrected"] == 2
    assert report["fabric"] == {"label": "ib-a", "address": "10.0.0.5", "interface": "ib0"}


def test_readings_are_cached_between_heartbeats():
    now = [0.0]
    run = fake_smi("a100-nvlink-pair")
    probe = Probe(AgentConfig(), run=run, ib_root=Path("/nonexistent"), clock=lambda: now[0])
    probe.report()
    probe.report()
    assert len(run.calls) == 2  # topo once, health once
    now[0] = 11.0
    probe.report()
    assert len(run.calls) == 3  # health again; the matrix is fresh for a minute


def test_gpus_set_to_zero_never_asks_nvidia_smi():
    run = fake_smi("a100-nvlink-pair")
    report = Probe(AgentConfig(gpus=0), run=run, ib_root=Path("/nonexistent")).report()
    assert run.calls == []
    assert report["matrix"] is None and report["health"] == []


def test_no_nvidia_smi_reports_none_without_an_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert run_nvidia_smi(["topo", "-m"]) == ""
    report = Probe(AgentConfig(), ib_root=Path("/nonexistent")).report()
    assert report["matrix"] is None and report["health"] == [] and report["infiniband"] == []


def test_a_failing_or_garbled_driver_reports_none_says_so_once_and_keeps_the_agent_going(
    caplog,
):
    def broken(args):
        if args[0] == "topo":
            raise subprocess.CalledProcessError(9, ["nvidia-smi"], "", "NVML: Driver Not Loaded")
        return "Failed to initialize NVML: Driver/library version mismatch\n"

    now = [0.0]
    probe = Probe(AgentConfig(), run=broken, ib_root=Path("/nonexistent"), clock=lambda: now[0])
    report = probe.report()
    now[0] = 100.0
    probe.report()
    assert report["matrix"] is None and report["health"] == []
    warnings = [r.getMessage() for r in caplog.records if "probe_failed" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per reading, not one per heartbeat
    assert "nvidia-smi exited 9: NVML: Driver Not Loaded" in warnings[0]
    assert "expected 13 fields" in warnings[1]


def sample(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_gpu_health_becomes_gauges_and_a_missing_figure_has_no_sample():
    probe = Probe(
        AgentConfig(), run=fake_smi("a100-nvlink-pair"), ib_root=FIX / "infiniband" / "pcie-4gpu"
    )
    metrics.update_topology(probe.report())
    uuid1 = "GPU-a9e3b7c1-58d2-4f0a-b6c4-e1d07f2a9b58"
    assert sample("llmgw_agent_gpu_temperature_celsius", gpu="1", uuid=uuid1) == 30.0
    assert sample("llmgw_agent_gpu_utilization_ratio", gpu="1", uuid=uuid1) is None
    assert sample("llmgw_agent_gpu_ecc_uncorrected_errors", gpu="1", uuid=uuid1) is None
    uuid0 = "GPU-6d2f1a9e-c4b3-47d8-a5e0-2f9c8b1d7e36"
    assert sample("llmgw_agent_gpu_memory_total_bytes", gpu="0", uuid=uuid0) == 81920 * 2**20
    assert sample("llmgw_agent_ib_port_active", device="mlx5_0", port="1",
                  link_layer="InfiniBand") == 0  # fmt: skip
    assert sample("llmgw_agent_ib_port_rate_bits_per_second", device="mlx5_0", port="1",
                  link_layer="InfiniBand") == 100e9  # fmt: skip
    metrics.update_topology({"health": [], "infiniband": []})
    assert sample("llmgw_agent_gpu_temperature_celsius", gpu="1", uuid=uuid1) is None


def test_each_gpu_shows_its_power_its_health_and_the_replica_assigned_it():
    cfg = AgentConfig()
    probe = Probe(cfg, run=fake_smi("h100-sxm-8gpu"), ib_root=Path("/nonexistent"))
    uuid = [g.uuid for g in probe.health()]
    shards = [
        {"id": "r-aa", "model": "llama-70b", "state": "ready", "gpus": [uuid[2], uuid[3]]},
        {"id": "r-bb", "model": "qwen", "state": "stopped", "gpus": [uuid[4]]},  # let go
    ]
    body = {"shards": shards, "engines": {}, "topology": probe.report(),
            "resources": Resources(cfg, probe=probe).snapshot()}  # fmt: skip
    metrics.update(body)
    assert sample("llmgw_agent_gpu_power_watts", gpu="2", uuid=uuid[2]) == 512.44
    healthy = [sample("llmgw_agent_gpu_healthy", gpu=str(i), uuid=u) for i, u in enumerate(uuid)]
    assert healthy == [1, 1, 1, 1, 1, 0, 0, 1]  # 5: ECC errors; 6: a row remap pending
    assigned = {(s.labels["gpu"], s.labels["uuid"], s.labels["model"], s.labels["replica"])
                for m in REGISTRY.collect() if m.name == "llmgw_agent_gpu_assigned"
                for s in m.samples if s.value == 1}  # fmt: skip
    assert assigned == {("2", uuid[2], "llama-70b", "r-aa"), ("3", uuid[3], "llama-70b", "r-aa")}


def test_a_gpu_without_a_power_reading_has_no_power_sample():
    cfg = AgentConfig()
    probe = Probe(cfg, run=fake_smi("pcie-4gpu"), ib_root=Path("/nonexistent"))
    metrics.update_topology(probe.report())
    uuids = [g.uuid for g in probe.health()]
    assert sample("llmgw_agent_gpu_power_watts", gpu="0", uuid=uuids[0]) == 112.5
    assert sample("llmgw_agent_gpu_power_watts", gpu="2", uuid=uuids[2]) is None  # [N/A]
    assert sample("llmgw_agent_gpu_power_watts", gpu="3", uuid=uuids[3]) is None  # [Not Supported]


@pytest.fixture
def smi_bin(tmp_path) -> Path:
    """A directory whose nvidia-smi prints the 2×A100 captures, first on PATH."""
    bindir = tmp_path / "bin"
    smi.write(bindir)
    return bindir


def start_agent(node, tmp_path: Path, path: str, metrics_port: int) -> Proc:
    cfg = node.config(metrics_listen=f"127.0.0.1:{metrics_port}", fabric="lab",
                      fabric_address="127.0.0.1", fabric_interface="lo")  # fmt: skip
    proc = Proc([sys.executable, "-m", "llmgw_agentd.main", "--config", str(cfg)],
                tmp_path / "agent.log", env={"PATH": path})  # fmt: skip
    node.procs.append(proc)
    return proc


def test_the_agent_tells_the_scheduler_its_gpu_topology_and_serves_gpu_metrics(
    scheduler, node, tmp_path, smi_bin
):
    port = free_port()
    start_agent(node, tmp_path, f"{smi_bin}:{os.environ['PATH']}", port)
    hello = scheduler.wait("hello")
    assert hello["node"] == NODE
    topo = hello["topology"]
    assert topo["matrix"]["links"] == {"0-1": "NV12"}
    assert [g["index"] for g in topo["health"]] == [0, 1]
    assert topo["fabric"] == {"label": "lab", "address": "127.0.0.1", "interface": "lo"}

    def temperature():
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        return 'llmgw_agent_gpu_temperature_celsius{gpu="0",uuid="GPU-6d2f' in text

    eventually(temperature, what="the GPU temperature gauge")


def test_an_agent_without_nvidia_smi_reports_no_topology_and_logs_no_error(
    scheduler, node, tmp_path
):
    bindir = tmp_path / "nobin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    proc = start_agent(node, tmp_path, str(bindir), free_port())
    hello = scheduler.wait("hello")
    assert hello["topology"]["matrix"] is None
    assert hello["topology"]["health"] == []
    eventually(lambda: len(scheduler.messages("heartbeat")) >= 1, what="a heartbeat")
    assert "probe_failed" not in proc.log()
