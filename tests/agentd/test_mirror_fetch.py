"""The real agent fetching weights from a mirror (tests/weights_server.py standing in for
the scheduler's, which tests/system/test_mirror.py runs for real): resuming after a kill,
refusing a corrupt file, progress in heartbeats, and the bounded cache."""

import hashlib
import json
import os
import signal

import pytest

from tests.agentd.conftest import NODE, start_body
from tests.helpers import eventually
from tests.weights_server import WeightsServer

MiB = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def mirror():
    server = WeightsServer({})
    yield server
    server.stop()


def mirrored(server: WeightsServer, name: str, data: bytes, served: bytes | None = None) -> dict:
    """Put `data` in the fake mirror (or `served` in its place) and return the
    start_shard `mirror` field naming it."""
    server.files[f"v1/mirror/blobs/{sha(data)}"] = data if served is None else served
    return {
        "url": f"http://127.0.0.1:{server.httpd.server_port}", "node": NODE, "token": "t",
        "sha256": sha(data), "files": [{"name": name, "sha256": sha(data), "size": len(data)}],
    }  # fmt: skip


def test_an_agent_killed_mid_fetch_resumes_with_a_range_request(scheduler, node, mirror):
    data = os.urandom(8 * MiB)
    m = mirrored(mirror, "big.gguf", data)
    mirror.stall_after = 3 * MiB
    first = node.start()
    scheduler.wait("hello")
    scheduler.send(NODE, "start_shard", start_body("r-1", "/nowhere/big.gguf", mirror=m))
    eventually(mirror.stalled.is_set, timeout=15, what="the mirror to have sent 3 MiB")
    # Progress is visible while it fetches.
    beat = scheduler.wait("heartbeat", lambda b: b.get("fetching"), timeout=10)
    assert beat["fetching"][0]["sha256"] == sha(data)
    assert beat["fetching"][0]["size"] == len(data)
    first.stop(signal.SIGKILL)
    mirror.stall_after = None
    mirror.release.set()
    partial = node.state / "weights" / "partial" / sha(data)
    kept = eventually(lambda: partial.exists() and partial.stat().st_size, timeout=5,
                      what="the partial file")  # fmt: skip
    assert kept > 0

    scheduler.forget()
    node.start()
    scheduler.wait("hello", timeout=15)
    scheduler.send(NODE, "start_shard", start_body("r-2", "/nowhere/big.gguf", mirror=m))
    node.remember(scheduler.wait_shard("r-2", "ready"))
    ranges = [r for path, r in mirror.requests if path.endswith(sha(data))]
    assert ranges[0] == "" and ranges[-1] == f"bytes={kept}-", ranges
    got = node.state / "weights" / "sha256" / sha(data) / "big.gguf"
    assert got.read_bytes() == data
    assert not partial.exists()


def test_a_corrupt_file_from_the_mirror_is_refused_and_deleted(scheduler, node, mirror):
    data = b"GGUF" + os.urandom(MiB)
    m = mirrored(mirror, "m.gguf", data, served=b"GGUF" + os.urandom(MiB))
    node.start()
    scheduler.wait("hello")
    scheduler.send(NODE, "start_shard", start_body("r-1", "/nowhere/m.gguf", mirror=m))
    failed = scheduler.wait_shard("r-1", "failed")
    assert "sha256 mismatch" in failed["reason"] and sha(data) in failed["reason"]
    weights = node.state / "weights"
    assert [p for p in weights.rglob("*") if p.is_file()] == []


def test_eviction_keeps_the_bound_but_never_a_running_shards_weights(scheduler, node, mirror):
    a, b, c = (bytes([i]) * (3 * MiB) for i in (1, 2, 3))
    node.start(weights_max_bytes=7 * MiB)
    scheduler.wait("hello")
    # a runs; b is fetched for a shard that then stops; c's fetch passes the bound.
    scheduler.send(
        NODE,
        "start_shard",
        start_body("r-a", "/nowhere/a.gguf", mirror=mirrored(mirror, "a.gguf", a)),
    )
    node.remember(scheduler.wait_shard("r-a", "ready"))
    scheduler.send(
        NODE,
        "start_shard",
        start_body("r-b", "/nowhere/b.gguf", mirror=mirrored(mirror, "b.gguf", b)),
    )
    node.remember(scheduler.wait_shard("r-b", "ready"))
    scheduler.send(NODE, "stop_shard", {"id": "r-b"})
    scheduler.wait_shard("r-b", "stopped")
    # a is the least recently used entry, but its shard runs.
    os.utime(node.state / "weights" / "sha256" / sha(a), (1, 1))
    scheduler.send(
        NODE,
        "start_shard",
        start_body("r-c", "/nowhere/c.gguf", mirror=mirrored(mirror, "c.gguf", c)),
    )
    node.remember(scheduler.wait_shard("r-c", "ready"))  # fmt: skip
    entries = sorted(p.name for p in (node.state / "weights" / "sha256").iterdir())
    assert entries == sorted([sha(a), sha(c)])
    state = json.loads((node.state / "shards" / "r-a.json").read_text())
    assert state["weights"] == [f"sha256/{sha(a)}"]
