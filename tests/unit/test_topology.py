"""Parsing nvidia-smi and sysfs from captured shapes, and choosing GPUs for a group."""

from pathlib import Path

import pytest

from llmgw import topology
from llmgw.topology import Topology, TopologyError, choose_gpus

FIX = Path(__file__).parent.parent / "fixtures" / "topology"


def topo(name: str) -> Topology:
    return topology.parse_topo_matrix((FIX / f"{name}.topo.txt").read_text())


def test_an_nvswitch_box_has_nv18_between_every_pair_and_names_its_nics():
    t = topo("h100-sxm-8gpu")
    assert t.gpus == list(range(8))
    assert len(t.links) == 28
    assert set(t.links.values()) == {"NV18"}
    assert t.nics == [f"mlx5_{i}" for i in range(10)]
    assert t.nic_links[(0, "mlx5_0")] == "PIX"
    assert t.nic_links[(0, "mlx5_4")] == "SYS"
    assert t.cpu_affinity[5] == "56-111,168-223"
    assert t.numa_affinity == {i: "0" if i < 4 else "1" for i in range(8)}


def test_a_pcie_box_reads_pix_pxb_and_sys_from_the_space_aligned_layout():
    t = topo("pcie-4gpu")
    assert t.gpus == [0, 1, 2, 3]
    assert t.link(0, 1) == "PIX"
    assert t.link(2, 0) == "PXB"
    assert t.link(3, 1) == "SYS"
    assert t.nics == ["mlx5_0"]
    assert t.nic_links[(3, "mlx5_0")] == "SYS"
    assert t.cpu_affinity[3] == "12-23,36-47"
    assert t.numa_affinity == {}


def test_an_nvlink_pair_without_nics():
    t = topo("a100-nvlink-pair")
    assert t.links == {(0, 1): "NV12"}
    assert t.nics == []
    assert t.numa_affinity == {0: "0", 1: "0"}


def test_a_topology_survives_the_trip_to_the_scheduler():
    t = topo("h100-sxm-8gpu")
    assert Topology.from_dict(t.as_dict()) == t


@pytest.mark.parametrize(
    "text, says",
    [
        ("nvidia-smi: command failed\n", "no matrix header"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \nGPU2\tNV4\tNV4\n", "unknown device 'GPU2'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tQPI\nGPU1\tQPI\t X \n", "unknown link class 'QPI'"),
        ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n", "row GPU0 has 1 cells, expected 2"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tPIX\t X \n", "GPU1-GPU0 is PIX one way and NV4 back"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "no matrix row for GPU1"),
    ],
)
def test_a_matrix_that_cannot_be_read_says_why(text, says):
    with pytest.raises(TopologyError, match=says):
        topology.parse_topo_matrix(text)


def test_gpu_health_reads_figures_in_bytes_and_percent():
    gpus = topology.parse_gpu_health((FIX / "h100-sxm-8gpu.health.csv").read_text())
    assert [g.index for g in gpus] == list(range(8))
    g2 = gpus[2]
    assert g2.name == "NVIDIA H100 80GB HBM3"
    assert g2.memory_total == 81559 * 1024 * 1024
    assert g2.memory_used == 71234 * 1024 * 1024
    assert g2.utilization == 97.0
    assert g2.temperature == 30.0
    assert [g.ecc_uncorrected for g in gpus] == [0, 0, 0, 0, 0, 2, 0, 0]


def test_gpu_health_reads_free_memory_pending_resets_and_mig_mode():
    h100 = topology.parse_gpu_health((FIX / "h100-sxm-8gpu.health.csv").read_text())
    assert h100[2].memory_free == 10325 * 1024 * 1024
    assert [g.remapped_rows_pending for g in h100] == [False] * 6 + [True, False]
    assert {g.mig for g in h100} == {"Disabled"}
    a100 = topology.parse_gpu_health((FIX / "a100-nvlink-pair.health.csv").read_text())
    assert [g.mig for g in a100] == ["Disabled", "Enabled"]


def test_a_gpu_with_uncorrectable_errors_or_a_reset_pending_is_unhealthy_with_the_reason():
    h100 = topology.parse_gpu_health((FIX / "h100-sxm-8gpu.health.csv").read_text())
    assert [g.problem for g in h100] == [""] * 5 + [
        "2 uncorrectable ECC errors",
        "row remapping pending (needs a GPU reset)",
        "",
    ]
    assert h100[5].resource()["healthy"] is False
    assert h100[5].resource()["health"] == "2 uncorrectable ECC errors"
    pcie = topology.parse_gpu_health((FIX / "pcie-4gpu.health.csv").read_text())
    assert pcie[1].problem == "retired pages pending (needs a GPU reset)"
    assert pcie[0].resource() == {
        "index": 0, "uuid": "GPU-3f0a6c1d-2b8e-4d55-a1c9-7e2f0b9d4c10", "name": "NVIDIA RTX A6000",
        "memory_total": 49140 * 2**20, "memory_free": 30907 * 2**20, "healthy": True,
        "health": "", "mig": "",
    }  # fmt: skip


def test_figures_a_card_cannot_give_are_unknown_not_a_fault():
    # GeForce cards say [N/A] for ECC, retired pages, row remaps and MIG.
    pcie = topology.parse_gpu_health((FIX / "pcie-4gpu.health.csv").read_text())
    g = pcie[2]
    assert (g.ecc_uncorrected, g.retired_pages_pending, g.remapped_rows_pending, g.mig) == (
        None, None, None, "")  # fmt: skip
    assert g.problem == "" and g.resource()["healthy"] is True
    line = "0, GPU-x, H100, 81559, 0, 0, 31, 0, 81559, Pending?, [Unknown Error], [N/A], [N/A]\n"
    (odd,) = topology.parse_gpu_health(line)
    assert odd.problem == "" and odd.retired_pages_pending is None


def test_an_older_driver_answering_the_basic_fields_leaves_the_rest_unknown():
    line = "0, GPU-x, Tesla T4, 15360, 0, 0, 40, 0, 15000\n"
    (g,) = topology.parse_gpu_health(line, topology.GPU_BASIC_FIELDS)
    assert g.memory_free == 15000 * 2**20 and g.remapped_rows_pending is None and g.mig == ""
    assert g.power is None


def test_gpu_health_turns_not_available_and_not_supported_into_none():
    pcie = topology.parse_gpu_health((FIX / "pcie-4gpu.health.csv").read_text())
    assert pcie[2].ecc_uncorrected is None
    assert pcie[3].utilization is None
    assert pcie[0].ecc_uncorrected == 0
    a100 = topology.parse_gpu_health((FIX / "a100-nvlink-pair.health.csv").read_text())
    mig = a100[1]
    assert (mig.memory_used, mig.utilization, mig.ecc_uncorrected) == (None, None, None)
    assert mig.temperature == 30.0
    assert (a100[0].power, mig.power) == (61.37, None)
    assert (pcie[0].power, pcie[2].power, pcie[3].power) == (112.5, None, None)


@pytest.mark.parametrize(
    "line, says",
    [
        ("0, GPU-x, H100, 81559, 0, 0, 31\n", "expected 13 fields"),
        (
            "0, GPU-x, H100, 81559, 0, lots, 31, 0, 1, No, No, Disabled, 70.5\n",
            "utilization.gpu is 'lots'",
        ),
        (
            "GPU0, GPU-x, H100, 81559, 0, 0, 31, 0, 1, No, No, Disabled, 70.5\n",
            "GPU index is 'GPU0'",
        ),
        (
            "0, GPU-x, H100, 81559, 0, 0, 31, 0, lots, No, No, Disabled, 70.5\n",
            "memory.free is 'lots'",
        ),
        ("0, GPU-x, H100, 81559, 0, 0, 31, 0, 1, No, No, Disabled, 70 W\n", "power.draw is '70 W'"),
    ],
)
def test_gpu_health_that_cannot_be_read_says_why(line, says):
    with pytest.raises(TopologyError, match=says):
        topology.parse_gpu_health(line)


def test_infiniband_ports_with_state_rate_and_link_layer():
    ports = topology.read_ib_ports(FIX / "infiniband" / "h100-sxm-8gpu")
    assert [p.device for p in ports] == [f"mlx5_{i}" for i in range(10)]
    p0 = ports[0]
    assert (p0.port, p0.state, p0.phys_state, p0.rate_gbps, p0.link_layer) == (
        1, "ACTIVE", "LinkUp", 400.0, "InfiniBand")  # fmt: skip
    assert p0.active
    assert not ports[3].active and ports[3].state == "DOWN" and ports[3].phys_state == "Disabled"
    assert ports[8].link_layer == "Ethernet" and ports[8].rate_gbps == 100.0


def test_a_port_waiting_for_its_subnet_manager_is_not_active():
    (port,) = topology.read_ib_ports(FIX / "infiniband" / "pcie-4gpu")
    assert port.state == "INIT" and port.phys_state == "LinkUp" and not port.active


def test_no_infiniband_directory_means_no_ports(tmp_path):
    assert topology.read_ib_ports(tmp_path / "absent") == []


def test_a_port_without_a_state_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    with pytest.raises(TopologyError, match="mlx5_0/ports/1/state"):
        topology.read_ib_ports(tmp_path)


# -- choosing GPUs -------------------------------------------------------------------------


def test_a_pair_on_the_pcie_box_takes_the_two_gpus_behind_one_switch():
    choice = choose_gpus(topo("pcie-4gpu"), [0, 1, 2, 3], 2)
    assert choice.gpus == (0, 1)
    assert choice.link == "PIX"
    assert choice.why == "GPUs 0,1 joined by PIX (pcie)"


def test_when_the_switch_pair_is_busy_the_best_remaining_link_is_chosen_and_named():
    choice = choose_gpus(topo("pcie-4gpu"), [1, 2, 3], 2)
    assert choice.gpus == (1, 2) and choice.link == "PXB"
    choice = choose_gpus(topo("pcie-4gpu"), [0, 3], 2)
    assert choice.gpus == (0, 3) and choice.link == "SYS"
    assert "system" in choice.why


def test_three_gpus_on_the_pcie_box_avoid_the_other_socket():
    assert choose_gpus(topo("pcie-4gpu"), [0, 1, 2, 3], 3).gpus == (0, 1, 2)


def test_nvlink_is_preferred_over_pcie_when_both_are_free():
    t = Topology(
        gpus=[0, 1, 2, 3],
        links={(0, 1): "PIX", (0, 2): "SYS", (0, 3): "SYS", (1, 2): "SYS", (1, 3): "SYS",
               (2, 3): "NV4"},
        numa_affinity={0: "0", 1: "0", 2: "1", 3: "1"},
    )  # fmt: skip
    choice = choose_gpus(t, [0, 1, 2, 3], 2)
    assert choice.gpus == (2, 3) and choice.link == "NV4"
    assert choice.why == "GPUs 2,3 joined by NV4 (nvlink)"


def test_on_an_nvswitch_box_four_gpus_stay_on_one_numa_node():
    choice = choose_gpus(topo("h100-sxm-8gpu"), [2, 3, 4, 5, 6, 7], 4)
    assert choice.gpus == (4, 5, 6, 7) and choice.link == "NV18"


def test_more_gpus_than_are_free_is_no_choice():
    assert choose_gpus(topo("a100-nvlink-pair"), [1], 2) is None
    assert choose_gpus(topo("a100-nvlink-pair"), [0, 1], 0) is None


def test_one_gpu_needs_no_link():
    choice = choose_gpus(topo("a100-nvlink-pair"), [1], 1)
    assert choice.gpus == (1,) and choice.link == ""


def test_a_gpu_missing_from_the_matrix_counts_as_the_slowest_link():
    choice = choose_gpus(topo("a100-nvlink-pair"), [0, 1, 2], 2)
    assert choice.gpus == (0, 1) and choice.link == "NV12"
    assert choose_gpus(topo("a100-nvlink-pair"), [1, 2], 2).link == "SYS"


def test_a_large_box_is_chosen_greedily_and_still_prefers_nvlink():
    # 24 GPUs in three NVLink islands of 8; choosing 12 is past the exhaustive bound.
    gpus = list(range(24))
    links = {}
    for a in gpus:
        for b in gpus:
            if a < b:
                links[(a, b)] = "NV12" if a // 8 == b // 8 else "SYS"
    t = Topology(gpus=gpus, links=links)
    choice = choose_gpus(t, gpus[4:], 6)
    assert choice.link == "NV12"
    assert len({g // 8 for g in choice.gpus}) == 1


def test_a_hybrid_cube_mesh_reads_its_nv1_and_nv2_links_and_gaps():
    t = topo("dgx1-v100-8gpu")
    assert t.link(0, 3) == "NV2" and t.link(0, 1) == "NV1" and t.link(0, 5) == "SYS"
    assert t.nics == ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]
    assert t.nic_links[(6, "mlx5_3")] == "PIX"
    assert sum(1 for v in t.links.values() if v.startswith("NV")) == 16


def test_on_a_hybrid_cube_mesh_the_doubled_links_are_preferred():
    t = topo("dgx1-v100-8gpu")
    assert choose_gpus(t, list(range(8)), 2).gpus == (0, 3)
    assert choose_gpus(t, [0, 5, 6], 2) == topology.GpuChoice(
        (5, 6), "NV2", "GPUs 5,6 joined by NV2 (nvlink)")  # fmt: skip
    four = choose_gpus(t, list(range(8)), 4)
    assert four.gpus == (0, 1, 2, 3) and four.link == "NV1"  # every pair on NVLink


def test_without_a_numa_column_the_cpu_affinity_keeps_a_group_on_one_socket():
    t = Topology(gpus=[0, 1, 2], links={(0, 1): "SYS", (0, 2): "SYS", (1, 2): "SYS"},
                 cpu_affinity={0: "0-9", 1: "10-19", 2: "10-19"})  # fmt: skip
    assert choose_gpus(t, [0, 1, 2], 2).gpus == (1, 2)
