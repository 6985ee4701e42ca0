"""A removed peer's keypair: deleted wherever a copy is kept, and never let back in by
an `add` of its name on a machine that still has a copy."""

import pytest

from llmgw import audit, bus, peers
from llmgw.store import BusPeer, DrainedNode, ReplicaIntent, migrate, open_store


@pytest.fixture
def db(tmp_path):
    db = open_store(f"sqlite://{tmp_path}/store.db")
    migrate(db)
    yield db
    db.close()


def remove(keys_dir, name, kind="agent"):
    """`nodes remove` as the admin API and `--store` do it: the peer, then its audit entry."""
    peer = peers.remove(keys_dir, name, kind)
    audit.record("nodes.remove" if kind == "agent" else "routers.remove", "ada", "local", name,
                 **peers.removal_detail(peer))  # fmt: skip
    return peer


def test_a_copy_of_a_removed_keypair_is_found_by_its_key_and_deleted(db, tmp_path):
    here, there = tmp_path / "cp1", tmp_path / "cp2"
    public = peers.register(here, "gpu-07", "agent").public_key
    there.mkdir()
    for f in ("gpu-07.key", "gpu-07.key_secret"):
        (there / f).write_bytes((here / f).read_bytes())
    bus.create_keypair(there, "gpu-09")  # another key: not this removal's to delete

    remove(here, "gpu-07")
    assert list(here.glob("gpu-07.*")) == []
    removed, last = peers.removed_since(0)
    assert removed == [("gpu-07", public)] and last > 0
    assert peers.removed_since(last) == ([], last)
    assert peers.drop_keypair(there, "gpu-09", public) is False
    assert peers.drop_keypair(there, "gpu-07", public) is True
    assert list(there.glob("gpu-07.*")) == [] and (there / "gpu-09.key_secret").exists()
    assert peers.drop_keypair(there, bus.SCHEDULER, public) is False


def test_adding_a_removed_name_where_its_old_keypair_was_kept_makes_a_new_key(db, tmp_path):
    here, there = tmp_path / "cp1", tmp_path / "cp2"
    old = peers.register(here, "gpu-07", "agent").public_key
    there.mkdir()
    for f in ("gpu-07.key", "gpu-07.key_secret"):
        (there / f).write_bytes((here / f).read_bytes())
    remove(here, "gpu-07")

    new = peers.register(there, "gpu-07", "agent").public_key
    assert new != old
    assert bus.load_public(there, "gpu-07") == new
    # A keypair never removed is kept, as before: an `add` again is idempotent.
    assert peers.register(there, "gpu-07", "agent").public_key == new


def test_removing_a_node_forgets_its_drain_and_the_start_intents_placed_on_it(db, tmp_path):
    peers.register(tmp_path, "gpu-07", "agent")
    DrainedNode.create(name="gpu-07", since=1.0)
    ReplicaIntent.create(id="r-1", model="m", node="gpu-07", profile="p", epoch=1,
                         created_at=1.0)  # fmt: skip
    ReplicaIntent.create(id="r-2", model="m", node="gpu-08", profile="p", epoch=1,
                         created_at=1.0)  # fmt: skip
    remove(tmp_path, "gpu-07")
    assert BusPeer.select().count() == 0 and DrainedNode.select().count() == 0
    assert [r.id for r in ReplicaIntent.select()] == ["r-2"]
