"""Each model's traffic per minute: summed from usage rows in the store (SQLite and
PostgreSQL), kept for a day, and read back as chart series."""

import pytest

from llmgw.store import Usage, migrate, open_store
from llmgw_scheduler.readings import read_minutes, top
from llmgw_scheduler.traffic import OTHER, Minute, Traffic

T0 = 1_800_000_000.0  # a whole minute (and hour): 2027-01-15 08:00:00 UTC


def test_a_minute_read_again_is_replaced_whole_and_minutes_older_than_a_day_go():
    t = Traffic()
    t.replace(T0 - 86400, {int(T0 - 86400): {"m": Minute(5)}, int(T0): {"m": Minute(1)}}, T0 + 60)
    assert t.total("m", 0).requests == 6
    t.replace(T0, {int(T0): {"m": Minute(3)}}, T0 + 120)  # late rows for 08:00
    assert t.minutes[int(T0)]["m"].requests == 3, "not 1 + 3"
    t.replace(T0 + 60, {}, T0 + 86400 + 30)
    assert int(T0 - 86400) not in t.minutes, "a day and more old"
    assert int(T0) in t.minutes


def test_a_series_is_a_rate_per_minute_with_quiet_minutes_at_zero_and_no_ttft_as_gaps():
    t = Traffic()
    rows = {int(T0): {"m": Minute(requests=30, errors=3, ttft_ms_sum=900.0, ttft_n=3,
                                  completion_tokens=600)},
            int(T0 + 120): {"m": Minute(requests=6)}}  # fmt: skip
    t.replace(T0, rows, T0 + 180)
    assert t.series("m", "requests", T0, T0 + 180, 60) == [
        (T0 + 30, 30.0), (T0 + 90, 0.0), (T0 + 150, 6.0)
    ]  # fmt: skip
    assert [y for _, y in t.series("m", "errors", T0, T0 + 180, 60)] == [3.0, 0.0, 0.0]
    assert [y for _, y in t.series("m", "ttft_ms", T0, T0 + 180, 60)] == [300.0, None, None]
    assert t.series("m", "tokens_per_s", T0, T0 + 60, 60) == [(T0 + 30, 10.0)]


def test_ten_minute_buckets_sum_their_minutes_and_the_minute_in_progress_is_left_out():
    t = Traffic()
    t.replace(T0, {int(T0 + 60 * i): {"m": Minute(requests=10)} for i in range(13)}, T0 + 750)
    ((x1, first), (x2, second)) = t.series("m", "requests", T0, T0 + 1200, 600)
    assert (x1, first) == (T0 + 300, 10.0), "100 requests over 10 minutes"
    # Read at 08:12:30: only 08:10 and 08:11 have passed of the second bucket.
    assert (x2, second) == (T0 + 900, 10.0)


def test_nothing_read_yet_is_no_series_at_all_not_a_flat_zero():
    assert Traffic().series("m", "requests", T0, T0 + 3600, 60) == []


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def row(at, model="m", served="m", status=200, c=5, ttft=None):
    Usage.create(at=at, request_id="r", key_id="k", model=model, served_model=served,
                 prompt_tokens=10, completion_tokens=c, status=status, latency_ms=50.0,
                 ttft_ms=ttft)  # fmt: skip


def test_usage_rows_are_summed_per_minute_and_model_in_the_store(db):
    aliases = {"m": "m", "m-alias": "m", "n": "n"}
    row(T0 + 1, ttft=100.0, c=7)
    row(T0 + 30, ttft=300.0, c=3)
    row(T0 + 59, status=503, served=None, c=0)
    row(T0 + 61, model="m-alias", served="m-alias", status=429, c=0)
    row(T0 + 61, model="n", served="n", c=9)
    row(T0 + 62, model="typo", served=None, status=404, c=0)
    row(T0 - 600)  # before `since`
    got = read_minutes(T0, aliases)
    assert got[int(T0)] == {
        "m": Minute(requests=3, client_errors=0, errors=1, ttft_ms_sum=400.0, ttft_n=2,
                    completion_tokens=10)
    }  # fmt: skip
    assert got[int(T0 + 60)] == {
        "m": Minute(requests=1, client_errors=1),
        "n": Minute(requests=1, completion_tokens=9),
        OTHER: Minute(requests=1, client_errors=1),
    }
    assert int(T0 - 600) not in got


def test_the_gauges_name_the_largest_users_and_sum_the_rest():
    rows = [{"team": f"t{i}", "prompt_tokens": i, "completion_tokens": i, "requests": 1}
            for i in range(1, 6)] + [{"team": None, "prompt_tokens": 100, "completion_tokens": 0,
                                     "requests": 2}]  # fmt: skip
    assert top(rows, "team", 3) == [("none", 100, 2), ("t5", 10, 1), ("others", 20, 4)]


class Sched:
    """What Readings reads of a scheduler: its lock, catalog names and leadership."""

    def __init__(self, leading=True):
        import threading
        from types import SimpleNamespace

        self.lock = threading.RLock()
        self.catalog = SimpleNamespace(by_alias={"m": "m"})
        self.leading = lambda: leading


def test_the_first_read_takes_the_last_day_and_later_ones_the_newest_minutes(db):
    from llmgw_scheduler.readings import Readings

    now = [T0]
    readings = Readings(Sched(), db, 60.0, clock=lambda: now[0])
    row(T0 - 86000, ttft=10.0)  # nearly a day ago
    row(T0 - 90000)  # more than a day ago
    readings.tick()
    assert readings.traffic.total("m", 0).requests == 1
    row(T0 + 30)
    row(T0 - 3000)  # late, but older than the minutes read again: not charted
    now[0] = T0 + 61
    readings.tick()
    traffic, usage, read_at = readings.snapshot()
    assert traffic.total("m", 0).requests == 2
    assert read_at == T0 + 61
    assert [r["key"] for r in usage[("key", "hour")]] == ["k"]
    assert usage[("key", "day")][0]["requests"] == 3, "the day's rows, the late one too"


def test_only_the_leader_publishes_the_usage_gauges(db):
    from llmgw_scheduler.readings import Readings

    row(T0 - 60)
    for leading, families in ((True, 2), (False, 0)):
        readings = Readings(Sched(leading), db, 60.0, clock=lambda: T0)
        readings.tick()
        got = list(readings.collect())
        assert len(got) == families
    leader = Readings(Sched(), db, 60.0, clock=lambda: T0)
    leader.tick()
    tokens, requests = leader.collect()
    samples = {tuple(s.labels.values()): s.value for s in tokens.samples}
    assert samples[("key", "k", "hour")] == 15
    assert {s.labels["window"] for s in requests.samples} == {"hour", "day"}


def test_a_refresh_of_zero_is_a_config_error_naming_the_key():
    from llmgw.config import Config
    from llmgw.errors import ConfigError
    from llmgw_scheduler.readings import check_refresh

    cfg = Config()
    check_refresh(cfg)
    cfg.scheduler.status_refresh_s = 0
    with pytest.raises(ConfigError, match=r"scheduler.status_refresh_s \(0\) must be > 0"):
        check_refresh(cfg)
