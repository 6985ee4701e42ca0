"""What a standby says about the leader it follows, and what `llmgw status` says of the
lease (pure: the lease and the schedulers' rows as read)."""

from llmgw.lease import Holder, standing
from llmgw_ctl.status import control_plane_line
from llmgw_scheduler.leadership import standby_news


def held(name: str, epoch: int, expires_in: float = 3.0) -> Holder:
    return Holder(holder=f"{name}/host/1/x", name=name, admin_url="", epoch=epoch,
                  expires_in=expires_in)  # fmt: skip


def test_a_standby_says_once_whom_it_follows_and_again_only_when_the_leader_changes():
    first = standby_news(None, held("s1", 4))
    assert first == ("s1", 4)
    assert standby_news(first, held("s1", 4)) is None  # every retry: nothing new
    assert standby_news(first, held("s3", 5)) == ("s3", 5)
    assert standby_news(first, held("s1", 6)) == ("s1", 6)  # the same one, started again


def test_a_standby_says_nothing_while_nobody_leads():
    assert standby_news(None, None) is None
    assert standby_news(("s1", 4), held("s1", 4, expires_in=-1.0)) is None


def said(held_, seen_s, schedulers, name="s2", role="standby") -> str:
    """The control-plane line `llmgw status` prints, as the scheduler `name` answers."""
    cp = standing(held_, seen_s, schedulers, renew_s=5.0, standby_retry_s=2.0)
    return control_plane_line({**cp, "schedulers": schedulers, "name": name, "role": role})


S2 = {"name": "s2", "role": "standby", "admin_url": "", "seen_s_ago": 0.4}


def test_status_shows_a_leader_heard_from_with_its_lease_as_before():
    line = said(held("s1", 7, expires_in=12.4), 0.8, [S2])
    assert line == (
        "LEADER s1 (epoch 7, lease 12.4s left)  STANDBY s2 (seen 0.4s ago)"
        "  [answered by s2, standby]"
    )


def test_status_says_a_leader_not_seen_for_longer_than_a_renewal_is_presumed_down():
    line = said(held("s1", 7, expires_in=8.2), 9.1, [S2])
    assert line.startswith(
        "LEADER s1 (epoch 7, not seen for 9.1s: presumed down; lease 8.2s left,"
        " s2 takes over when it runs out)  STANDBY s2"
    ), line
    # Within one renewal and a half (5 s): still heard from.
    assert "presumed down" not in said(held("s1", 7, expires_in=8.2), 7.4, [S2])
    # Its name's row is a new process's: the one holding the lease is gone.
    assert "s1 restarted since: presumed down" in said(held("s1", 7, expires_in=8.2), None, [S2])
    # No standby heard from lately: nobody will take over.
    late = {**S2, "seen_s_ago": 30.0}
    assert "no standby is running to take over" in said(held("s1", 7, 8.2), 9.1, [late])


def test_status_says_so_when_nobody_holds_a_valid_lease():
    line = said(held("s1", 7, expires_in=-1.3), 20.0, [S2])
    assert line.startswith(
        "LEADER none: no scheduler holds a valid lease (s1's, epoch 7, ran out 1.3s ago);"
        " nothing is placed or restarted until s2 takes it  STANDBY"
    ), line
    assert said(None, None, []).startswith(
        "LEADER none: no scheduler holds a valid lease; nothing is placed or restarted  ["
    )
