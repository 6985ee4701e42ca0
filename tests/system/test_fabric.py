"""`llmgw fabric test` through a real scheduler and two real agents on loopback, each on
its own loopback address as its fabric address."""

import json
import socket

from tests.helpers import eventually
from tests.system.conftest import GiB


def fabric(address: str, label: str = "lab") -> str:
    return f'fabric_address = "{address}"\nfabric_interface = "lo"\nfabric = "{label}"\n'


def reported(cluster, names: set[str]) -> bool:
    nodes = {n["name"]: n for n in cluster.admin("/v1/nodes")}
    return all(n in nodes and nodes[n]["state"] == "up" for n in names)


def test_fabric_test_measures_between_agents_on_one_fabric_and_says_why_a_pair_fails(cluster):
    cluster.start_scheduler()
    cluster.start_agent("fab-a", memory=GiB, extra=fabric("127.0.0.2"))
    cluster.start_agent("fab-b", memory=GiB, extra=fabric("127.0.0.3"))
    cluster.start_agent("plain", memory=GiB)
    cluster.start_agent("elsewhere", memory=GiB, extra=fabric("127.0.0.4", "other"))
    eventually(lambda: reported(cluster, {"fab-a", "fab-b", "plain", "elsewhere"}), timeout=20,
               what="four agents up")  # fmt: skip
    nodes = {n["name"]: n for n in cluster.admin("/v1/nodes")}
    assert nodes["fab-b"]["topology"]["fabric"] == {
        "label": "lab", "address": "127.0.0.3", "interface": "lo"}  # fmt: skip
    assert nodes["plain"]["topology"]["matrix"] is None  # no nvidia-smi here

    # No NODE: every pair with a fabric address on the same fabric, i.e. the one pair.
    result = cluster.ctl("fabric", "test", "--mib", "8", "--json")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["nodes"] == ["elsewhere", "fab-a", "fab-b"]
    (row,) = body["results"]
    assert (row["from"], row["to"], row["error"]) == ("fab-a", "fab-b", "")
    host, port = row["address"].rsplit(":", 1)
    assert host == "127.0.0.3"
    assert row["bytes"] == 8 << 20 and row["bits_per_second"] > 0
    assert 0 < row["latency_min_ms"] <= row["latency_ms"]

    def closed() -> bool:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return False
        except OSError:
            return True

    eventually(closed, what="the endpoint to close after its test")

    table = cluster.ctl("fabric", "test", "fab-b", "fab-a", "--mib", "1")
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.splitlines()
    assert header.split() == ["FROM", "TO", "ADDRESS", "LATENCY", "BANDWIDTH", "ERROR"]
    cells = line.split()  # FROM TO ADDRESS n ms n unit
    assert cells[:2] == ["fab-b", "fab-a"] and cells[2].startswith("127.0.0.2:")
    assert cells[4] == "ms" and cells[6] in ("Gbit/s", "Mbit/s") and len(cells) == 7

    failed = cluster.ctl("fabric", "test", "fab-a", "plain", "--json")
    assert failed.returncode == 1
    (row,) = json.loads(failed.stdout)["results"]
    assert row["error"].startswith("plain: agent.fabric_address is not set")

    unknown = cluster.ctl("fabric", "test", "fab-a", "nowhere")
    assert unknown.returncode != 0
    assert "node 'nowhere' is not connected" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
