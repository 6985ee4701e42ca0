"""What a standby says about the leader it follows (pure: the lease as read)."""

from llmgw.lease import Holder
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
