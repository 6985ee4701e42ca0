"""The usage rows against the engines' own counters: the engines' readings as running
totals (restarts, thinning), the window between two readings, the rows' side from the
store (SQLite and PostgreSQL), and the comparison the gauges and `llmgw usage
reconcile` show. Fake time throughout: readings and rows carry their own."""

import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from llmgw.config import UsageConfig
from llmgw.store import Usage, migrate, open_store
from llmgw_agentd import counters as agent_counters
from llmgw_scheduler import counters
from llmgw_scheduler.counters import EngineCounters, History, Reading
from llmgw_scheduler.usage_check import UsageCheck, reconcile

T = 1_800_000_000.0


def reading(at, prompt, generated, cached=0, process="100:1"):
    return {
        "at": at,
        "prompt": prompt,
        "cached": cached,
        "generated": generated,
        "process": process,
    }


def history(*readings) -> History:
    h = History("gemma")
    for r in readings:
        h.add(Reading.of(r))
    return h


# -- the engines' side -------------------------------------------------------------------


def test_readings_become_running_totals_from_the_first_one():
    h = history(reading(T, 1000, 50), reading(T + 2, 1100, 70, cached=30))
    first, second = h.points()
    assert (first.prompt, first.generated) == (0, 0)
    assert (second.prompt, second.generated, second.cached) == (100, 20, 30)


def test_a_new_engine_process_counts_from_zero_not_below_the_last_reading():
    h = history(
        reading(T, 1000, 50),
        reading(T + 2, 1100, 70),
        # the engine restarted: its counters began again, and already counted 40 and 5
        reading(T + 4, 40, 5, process="200:9"),
        reading(T + 6, 90, 15, process="200:9"),
    )
    assert [(p.prompt, p.generated) for p in h.points()] == [
        (0, 0),
        (100, 20),
        (140, 25),
        (190, 35),
    ]


def test_counters_that_go_down_mean_a_restart_even_under_the_same_process_name():
    h = history(reading(T, 1000, 50), reading(T + 2, 30, 4))
    assert (h.points()[-1].prompt, h.points()[-1].generated) == (30, 4)


def test_a_reading_heard_twice_counts_once():
    h = history(reading(T, 1000, 50), reading(T + 2, 1100, 70), reading(T + 2, 1100, 70))
    assert len(h.points()) == 2


def test_old_readings_are_thinned_to_one_a_minute_and_dropped_after_a_day():
    h = History("gemma")
    for i in range(3600):  # an hour of readings every 2 s, 10 tokens each
        h.add(Reading(T + 2 * i, 10 * i, i, 0, "p"))
    now = T + 7200
    h.trim(now)
    points = h.points()
    old = [p for p in points if p.at < now - counters.FINE_S]
    assert 95 <= len(old) <= 105  # 100 minutes... of which one an hour's worth remains
    assert all(b.at - a.at >= counters.COARSE_S for a, b in zip(old, old[1:], strict=False))
    # totals survive thinning: the increase over any two kept points is exact
    assert points[-1].prompt - points[0].prompt == 10 * (points[-1].at - points[0].at) / 2
    h.trim(now + counters.KEEP_S + 3600)
    assert [p.at for p in h.points()] == [points[-1].at]  # the newest stays until forgotten


def test_a_replica_not_heard_of_for_a_day_is_forgotten():
    c = EngineCounters()
    c.record("r-1", "gemma", reading(T, 10, 1))
    c.record("r-2", "gemma", reading(T + counters.KEEP_S, 10, 1))
    c.trim(T + counters.KEEP_S + 1)
    assert set(c.replicas) == {"r-2"}


def test_what_is_not_a_reading_is_ignored():
    c = EngineCounters()
    for bad in ({"at": T}, {"at": "soon", "prompt": 1, "generated": 1}, ["x"], None):
        c.record("r-1", "gemma", bad)
    assert c.replicas == {}


def test_the_window_is_bounded_by_the_readings_around_it():
    points = history(*(reading(T + 10 * i, 100 * i, 10 * i) for i in range(10))).points()
    start, end = counters.window(points, T + 25, T + 75)
    assert (start.at, end.at) == (T + 20, T + 70)
    start, end = counters.window(points, T - 500, T + 1000)  # before the first reading
    assert (start.at, end.at) == (T, T + 90)
    assert counters.window(points, T + 91, T + 200) is None  # nothing after since
    assert counters.window([], T, T + 10) is None


def test_llama_servers_six_digits_are_a_bound_beside_the_comparison():
    small = counters.Point(T, 0, 0, 0, magnitude=999_999)
    big = counters.Point(T + 60, 0, 0, 0, magnitude=12_345_678)  # printed 1.23457e+07
    assert counters.rounding(small, small) == 0
    assert counters.rounding(small, big) == 50


# -- the comparison ------------------------------------------------------------------------


def test_the_comparison_says_the_difference_as_a_part_of_the_engines_count():
    start = counters.Point(T, 0, 0, 0)
    end = counters.Point(T + 60, 1000, 300, 200)
    line = counters.compare("r-1", "gemma", start, end, counters.Tally(990, 200, 300, 7))
    assert line["router"] == {"prompt": 990, "completion": 200, "cached": 300, "requests": 7}
    assert line["engine"] == {"prompt": 1000, "completion": 200, "cached": 300}
    assert line["difference"] == {"prompt": -10, "completion": 0}
    assert line["ratio"] == {"prompt": -0.01, "completion": 0.0}
    idle = counters.compare("r-1", "gemma", start, start, counters.Tally())
    assert idle["ratio"] == {"prompt": None, "completion": None}


# -- the rows' side, from the store --------------------------------------------------------


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def row(end, latency_s, prompt, completion, ttft_s=None, endpoint="r-1", cached=None):
    Usage.create(
        at=end,
        request_id="q",
        key_id="k",
        model="gemma",
        served_model="gemma",
        endpoint=endpoint,
        prompt_tokens=prompt,
        completion_tokens=completion,
        status=200,
        latency_ms=latency_s * 1000.0,
        ttft_ms=None if ttft_s is None else ttft_s * 1000.0,
        cached_tokens=cached,
    )


def test_rows_are_placed_where_the_engine_counts_their_tokens(db):
    # (T, T + 100]: a whole answer inside; a stream whose prompt went before T but
    # whose answer ended inside; one whose prompt was evaluated inside and whose answer
    # ended after; another replica's row.
    row(T + 50, 10, 100, 10, cached=40)
    row(T + 5, 10, 1000, 20, ttft_s=2)  # prompt at T - 3: not this window's
    row(T + 130, 40, 500, 30, ttft_s=5)  # prompt at T + 95, completion after T + 100
    row(T + 20, 30, 50, 5, ttft_s=15)  # began before T, its first token at T + 5
    row(T + 50, 1, 7, 7, endpoint="r-2")
    from llmgw_scheduler.usage_check import router_tally

    tally = router_tally("r-1", T, T + 100)
    assert (tally.prompt, tally.completion, tally.cached, tally.requests) == (650, 35, 40, 3)


def test_reconcile_compares_every_replica_with_readings_in_the_window(db):
    c = EngineCounters()
    c.record("r-1", "gemma", reading(T, 5000, 500))
    c.record("r-1", "gemma", reading(T + 100, 5600, 530))
    c.record("r-2", "gemma", reading(T + 500, 10, 1))  # nothing in the window
    row(T + 50, 10, 600, 30)
    (line,) = reconcile(c.snapshot(), T, T + 200)
    assert (line["replica"], line["from"], line["to"]) == ("r-1", T, T + 100)
    assert line["difference"] == {"prompt": 0, "completion": 0}


def test_the_gauges_judge_a_replica_only_with_enough_tokens(db):
    sched = SimpleNamespace(
        lock=threading.RLock(), engine_counters=EngineCounters(), leading=lambda: True
    )
    now = T + 1000
    cfg = UsageConfig(reconcile_window_s=900, reconcile_settle_s=100, reconcile_min_tokens=500)
    for rid, prompt, completion in (("r-1", 1000, 100), ("r-2", 100, 10)):
        sched.engine_counters.record(rid, "gemma", reading(now - 900, 0, 0, process=rid))
        sched.engine_counters.record(
            rid, "gemma", reading(now - 200, prompt, completion, process=rid)
        )
        row(now - 300, 1, prompt - prompt // 50, completion, endpoint=rid)  # 2% short
    check = UsageCheck(sched, cfg, db, clock=lambda: now)
    registry = CollectorRegistry()
    registry.register(check)
    check.tick()
    ratio = {
        (s.labels["replica"], s.labels["kind"]): s.value
        for m in registry.collect()
        if m.name == "llmgw_usage_difference_ratio"
        for s in m.samples
    }
    assert ratio == {("r-1", "prompt"): -0.02}  # r-2 and completions: under 500 tokens
    assert registry.get_sample_value("llmgw_usage_reconcile_threshold_ratio") == 0.01
    quiet = {"model": "gemma", "replica": "r-2", "kind": "prompt"}
    assert registry.get_sample_value("llmgw_usage_engine_tokens", quiet) == 100


# -- the agent's reading -------------------------------------------------------------------

LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1.23457e+06
llamacpp:prompt_tokens_cached_total 400
llamacpp:tokens_predicted_total 5000
llamacpp:requests_processing 1
"""

VLLM_METRICS = """\
vllm:prompt_tokens_total{engine="0",model_name="m"} 300.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 200.0
vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="0",model_name="m label with } brace"} 120.0
vllm:num_requests_running{model_name="m"} 4.0
"""


def test_the_agent_reads_llama_servers_and_vllms_counters_alike():
    assert agent_counters.parse(LLAMA_METRICS) == {
        "prompt": 1_234_970,
        "cached": 400,
        "generated": 5000,
    }
    assert agent_counters.parse(VLLM_METRICS) == {"prompt": 500, "cached": 120, "generated": 50}
    without_hits = VLLM_METRICS.replace("vllm:prefix_cache_hits_total", "vllm:other")
    assert agent_counters.parse(without_hits)["cached"] is None
    assert agent_counters.parse("llamacpp:prompt_tokens_total 5\n") is None  # not all there
    assert agent_counters.parse("<html>not found</html>") is None
