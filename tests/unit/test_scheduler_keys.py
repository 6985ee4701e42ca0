"""The scheduler keys a peer trusts during a rotation, and the swap itself."""

import pytest

from llmgw import bus


def test_a_peer_trusts_the_next_key_beside_the_current_one_and_alternates(tmp_path):
    old = bus.create_keypair(tmp_path, bus.SCHEDULER)
    assert bus.scheduler_keys(tmp_path) == [old]
    assert bus.other_key(tmp_path, old) is None  # nothing else to try
    new = bus.create_keypair(tmp_path, bus.NEXT_SCHEDULER)
    assert bus.scheduler_keys(tmp_path) == [old, new]
    assert bus.other_key(tmp_path, old) == new
    assert bus.other_key(tmp_path, new) == old
    assert bus.other_key(tmp_path, "a key it never had") == old


def test_finishing_a_rotation_swaps_the_keypair_and_keeps_the_old_one_retired(tmp_path):
    old = bus.create_keypair(tmp_path, bus.SCHEDULER)
    new = bus.create_keypair(tmp_path, bus.NEXT_SCHEDULER)
    assert bus.rotate_scheduler_keys(tmp_path) == new
    assert bus.load_keypair(tmp_path, bus.SCHEDULER)[0].decode() == new
    assert bus.load_public(tmp_path, bus.RETIRED_SCHEDULER) == old
    assert not (tmp_path / f"{bus.NEXT_SCHEDULER}.key").exists()
    with pytest.raises(bus.BusError, match="rotate-scheduler` first"):
        bus.rotate_scheduler_keys(tmp_path)  # no next key: nothing is touched
    assert bus.load_public(tmp_path, bus.SCHEDULER) == new
