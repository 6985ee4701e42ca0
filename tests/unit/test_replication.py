"""Replication between schedulers: what is missing, whom to ask, where a cut copy
resumes (pure), and the worker against a real HTTP peer and a real store: a copy cut
mid-body resumes with Range, a corrupt one is refused, and a failing one backs off."""

import hashlib
import json
import os
import random

import pytest
from prometheus_client import REGISTRY

from llmgw import config, lease, mirror
from llmgw.mirror import File
from llmgw.store import MirroredWeights, PublishedRelease, SchedulerSeen, migrate, open_store
from llmgw_scheduler import replication
from llmgw_scheduler.replication import BLOB, RELEASE, Item
from llmgw_scheduler.replicator import Corrupt, Replicator, TransferError, transfer
from tests.weights_server import WeightsServer


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def f(name: str, data: bytes) -> File:
    return File(name, sha(data), len(data))


# -- what is missing, and whom to ask ----------------------------------------------------


def test_a_blob_two_models_share_is_wanted_once_and_releases_come_before_blobs():
    big, small, shared = b"b" * 30, b"s" * 10, b"x" * 20
    manifests = {"m1": [f("big", big), f("x", shared)], "m2": [f("s", small), f("x", shared)]}
    releases = [{"filename": "llmgw-0.2.0-py3-none-any.whl", "version": "0.2.0",
                 "sha256": "r" * 64, "size": 99, "published_at": 5.0}]  # fmt: skip
    items = replication.wanted(manifests, releases)
    assert [(i.kind, i.size) for i in items] == [(RELEASE, 99), (BLOB, 10), (BLOB, 20), (BLOB, 30)]
    (x,) = [i for i in items if i.sha256 == sha(shared)]
    assert (x.name, x.about) == (sha(shared), "m1,m2")


def test_what_is_held_is_not_missing_and_the_lag_counts_the_rest():
    items = [Item(BLOB, c * 64, n, c * 64, "m") for c, n in (("a", 10), ("b", 20), ("c", 30))]
    lacking = replication.missing(items, lambda i: i.name.startswith("b"))
    assert [i.size for i in lacking] == [10, 30]
    assert replication.lag(lacking) == (2, 40)
    assert replication.lag([]) == (0, 0)


def test_the_leader_is_asked_first_then_the_most_recently_seen_never_itself_or_the_long_silent():
    rows = [
        {"name": "s1", "role": "standby", "admin_url": "http://s1", "seen_s_ago": 0.1},
        {"name": "s2", "role": "leader", "admin_url": "http://s2", "seen_s_ago": 3.0},
        {"name": "s3", "role": "standby", "admin_url": "http://s3", "seen_s_ago": 1.0},
        {"name": "me", "role": "standby", "admin_url": "http://me", "seen_s_ago": 0.0},
        {"name": "gone", "role": "standby", "admin_url": "http://gone", "seen_s_ago": 900.0},
        {"name": "nourl", "role": "standby", "admin_url": "", "seen_s_ago": 0.0},
    ]
    assert [p.name for p in replication.peer_order(rows, "me", 600.0)] == ["s2", "s1", "s3"]


def test_a_copy_resumes_at_its_partials_end_unless_that_is_longer_than_the_blob():
    assert replication.resume_from(None, 100) == 0
    assert replication.resume_from(0, 100) == 0
    assert replication.resume_from(40, 100) == 40
    assert replication.resume_from(100, 100) == 100  # whole: only checked
    assert replication.resume_from(101, 100) == 0  # not this blob's beginning


def test_a_peers_answer_starts_where_its_status_and_content_range_say():
    assert replication.range_start(200, None) == 0
    assert replication.range_start(206, "bytes 40-99/100") == 40
    assert replication.range_start(206, None) is None
    assert replication.range_start(206, "bytes */100") is None
    assert replication.range_start(416, "bytes */100") is None
    assert replication.range_start(503, None) is None


# -- one transfer against a real HTTP peer -----------------------------------------------


@pytest.fixture
def peer():
    server = WeightsServer({})
    yield server
    server.stop()


def test_a_copy_cut_mid_body_keeps_what_arrived_and_the_next_try_resumes_with_range(tmp_path, peer):
    data = os.urandom(300_000)
    peer.files["b"] = data
    peer.cut_after = 100_000
    partial = tmp_path / "partial" / sha(data)
    with pytest.raises(TransferError) as cut:
        transfer(peer.url("b"), {}, partial, sha(data), len(data))
    assert cut.value.reason == "cut"
    kept = partial.stat().st_size
    assert 0 < kept < len(data) and partial.read_bytes() == data[:kept]
    got = []
    transfer(peer.url("b"), {}, partial, sha(data), len(data), received=got.append)
    assert partial.read_bytes() == data
    assert peer.requests[-1] == ("/b", f"bytes={kept}-")
    assert sum(got) == len(data) - kept  # only what the second try received


def test_a_corrupt_copy_is_refused_and_deleted_not_kept(tmp_path, peer):
    data = os.urandom(50_000)
    peer.files["b"] = os.urandom(len(data))  # the right size, other bytes
    partial = tmp_path / "partial" / sha(data)
    with pytest.raises(Corrupt, match=f"not {sha(data)}: deleted"):
        transfer(peer.url("b"), {}, partial, sha(data), len(data))
    assert not partial.exists()
    peer.files["b"] = data + b"more"  # longer than the blob can be
    with pytest.raises(Corrupt, match="more than the"):
        transfer(peer.url("b"), {}, partial, sha(data), len(data))
    assert not partial.exists()


def test_a_peer_without_the_blob_or_that_refuses_keeps_the_partial_for_another(tmp_path, peer):
    data = os.urandom(1000)
    partial = tmp_path / "p"
    partial.write_bytes(data[:10])
    with pytest.raises(TransferError) as absent:
        transfer(peer.url("nope"), {}, partial, sha(data), len(data))
    assert absent.value.reason == "absent" and partial.read_bytes() == data[:10]


# -- the worker, with a real store and a peer --------------------------------------------


@pytest.fixture
def store(tmp_path):
    db = open_store(f"sqlite://{tmp_path}/store.db")
    migrate(db)
    yield db
    db.close()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def worker(tmp_path, store, name: str, clock=None) -> Replicator:
    cfg = config.load(None)
    cfg.paths.state_dir = str(tmp_path / f"state-{name}")
    lease.seen(store, name, name, "standby", "http://127.0.0.1:1")
    return Replicator(cfg, store, name, "secret", lambda: False, rng=random.Random(1),
                      clock=clock or Clock())  # fmt: skip


def leader_at(store, peer) -> None:
    lease.seen(store, "s1", "s1", "leader", peer.url("").rstrip("/"))


def mirrored(model: str, *files: tuple[str, bytes]) -> None:
    manifest = [f(n, d) for n, d in files]
    MirroredWeights.create(model=model, source="x", sha256=mirror.content_id(manifest),
                           files=json.dumps([m.json() for m in manifest]), pinned_at=1,
                           size=sum(m.size for m in manifest), pulled_at=1)  # fmt: skip


def sample(name: str, scheduler: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, {"scheduler": scheduler, **labels}) or 0.0


def test_the_worker_copies_every_missing_blob_and_release_and_then_says_nothing_is_missing(
    tmp_path, store, peer
):
    from tests.unit.test_releases import wheel_bytes

    weights, wheel = os.urandom(200_000), wheel_bytes("0.3.0")
    filename = "llmgw-0.3.0-py3-none-any.whl"
    peer.files[f"v1/replication/blobs/{sha(weights)}"] = weights
    peer.files[f"v1/replication/releases/{filename}"] = wheel
    leader_at(store, peer)
    mirrored("m", ("m.gguf", weights))
    PublishedRelease.create(filename=filename, version="0.3.0", sha256=sha(wheel),
                            size=len(wheel), published_at=1234.0)  # fmt: skip
    w = worker(tmp_path, store, "copies")
    w.tick()
    blob = tmp_path / "state-copies" / "mirror" / "blobs" / "sha256" / sha(weights)
    assert blob.read_bytes() == weights
    rel = w.releases.find("0.3.0")
    assert (rel.sha256, rel.published) == (sha(wheel), 1234.0)
    assert sample("llmgw_mirror_replication_missing_blobs", "copies") == 0
    assert sample("llmgw_mirror_replication_copied_total", "copies") == 2
    assert sample("llmgw_mirror_replication_copied_bytes_total", "copies") == len(weights) + len(
        wheel
    )
    row = SchedulerSeen.get(SchedulerSeen.name == "copies")
    assert (row.missing_blobs, row.missing_bytes) == (0, 0)
    # The peer is asked with this scheduler's name and its token.
    assert all(path.startswith("/v1/replication/") for path, _ in peer.requests)


def test_a_corrupt_copy_is_counted_and_backed_off_and_a_good_peer_is_then_used(
    tmp_path, store, peer
):
    weights = os.urandom(10_000)
    peer.files[f"v1/replication/blobs/{sha(weights)}"] = os.urandom(len(weights))
    leader_at(store, peer)
    mirrored("m", ("m.gguf", weights))
    clock = Clock()
    w = worker(tmp_path, store, "corrupt", clock)
    w.tick()
    assert not w.mirror.has(f("m.gguf", weights))
    assert sample("llmgw_mirror_replication_failures_total", "corrupt", reason="corrupt") == 1
    assert sample("llmgw_mirror_replication_missing_blobs", "corrupt") == 1
    asked = len(peer.requests)
    w.tick()  # before its retry is due: the peer is not asked again
    assert len(peer.requests) == asked
    peer.files[f"v1/replication/blobs/{sha(weights)}"] = weights
    clock.now += w.retries[Item(BLOB, "", 0, sha(weights), "").key].next_at - clock.now
    w.tick()
    assert w.mirror.has(f("m.gguf", weights)) and w.retries == {}
    assert sample("llmgw_mirror_replication_missing_blobs", "corrupt") == 0


def test_with_no_peer_a_copy_backs_off_to_the_max_and_no_further(tmp_path, store):
    mirrored("m", ("m.gguf", b"weights"))
    clock = Clock()
    w = worker(tmp_path, store, "alone", clock)
    waits = []
    for _ in range(12):
        waits.append(w.tick())
        clock.now = max(b.next_at for b in w.retries.values())
    assert sample("llmgw_mirror_replication_failures_total", "alone", reason="no_peer") == 12
    assert sample("llmgw_mirror_replication_backoff_seconds", "alone") == w.backoff_max_s
    assert max(waits) <= w.interval_s  # it looks again at least every replicate_s
    steps = [w._step(n) for n in range(1, 13)]
    assert steps == sorted(steps) and steps[-1] == w.backoff_max_s


def test_a_node_asking_for_a_blob_has_it_copied_first_and_at_once(tmp_path, store, peer):
    a, b = os.urandom(1000), os.urandom(2000)  # smallest first, unless asked for
    leader_at(store, peer)
    mirrored("m", ("a.gguf", a), ("b.gguf", b))
    clock = Clock()
    w = worker(tmp_path, store, "hurry", clock)
    w.tick()  # neither is on the peer: both back off
    assert len(w.retries) == 2
    clock.now = max(r.next_at for r in w.retries.values())  # both due again
    peer.files[f"v1/replication/blobs/{sha(b)}"] = b
    peer.requests.clear()
    assert w.hurry(BLOB, sha(b)) >= 5.0
    w.tick()
    assert [p for p, _ in peer.requests] == [f"/v1/replication/blobs/{sha(x)}" for x in (b, a)]
    assert w.mirror.has(f("b.gguf", b)) and not w.mirror.has(f("a.gguf", a))
    # a has just failed again and backs off; asked for, it is tried at once all the same.
    peer.files[f"v1/replication/blobs/{sha(a)}"] = a
    w.hurry(BLOB, sha(a))
    w.tick()
    assert w.mirror.has(f("a.gguf", a))


def test_llmgw_status_says_how_far_each_schedulers_copy_is_behind():
    from llmgw_ctl.status import control_plane_line

    cp = {"name": "s2", "role": "standby",
          "leader": {"name": "s1", "epoch": 3, "expires_in": 9.0},
          "schedulers": [
              {"name": "s1", "role": "leader", "seen_s_ago": 0.2, "missing_blobs": 1,
               "missing_bytes": 3 << 20},
              {"name": "s2", "role": "standby", "seen_s_ago": 0.1, "missing_blobs": 0,
               "missing_bytes": 0},
              {"name": "s3", "role": "standby", "seen_s_ago": 0.3, "missing_blobs": 2,
               "missing_bytes": 5 << 30},
              {"name": "old", "role": "standby", "seen_s_ago": 0.4},  # never said
          ]}  # fmt: skip
    line = control_plane_line(cp)
    assert "s2 (seen 0.1s ago, mirror copied)" in line
    assert "s3 (seen 0.3s ago, 2 files (5 GiB) to copy)" in line
    assert "old (seen 0.4s ago)" in line
    assert "(s1 has 1 file (3 MiB) to copy)" in line
