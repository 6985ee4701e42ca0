"""The router's metric children, looked up once per label set, count what labels() would."""

from prometheus_client import REGISTRY

from llmgw_router import metrics


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_cached_children_count_into_the_same_series_as_labels():
    before = sample("llmgw_router_requests_total", model="cache-m", status="200")
    metrics.requests("cache-m", 200).inc()
    metrics.REQUESTS.labels("cache-m", "200").inc()
    assert metrics.requests("cache-m", 200) is metrics.requests("cache-m", 200)
    assert sample("llmgw_router_requests_total", model="cache-m", status="200") == before + 2
    metrics.api_requests("/v1/chat/completions", 429).inc()
    assert sample("llmgw_router_api_requests_total", api="/v1/chat/completions",
                  status="429") >= 1  # fmt: skip


def test_a_models_children_are_its_own_series():
    m = metrics.of_model("cache-served")
    assert metrics.of_model("cache-served") is m
    m.prompt_tokens.inc(3)
    m.completion_tokens.inc(5)
    m.duration.observe(0.2)
    assert sample("llmgw_router_tokens_total", model="cache-served", kind="prompt") == 3
    assert sample("llmgw_router_tokens_total", model="cache-served", kind="completion") == 5
    assert sample("llmgw_router_request_duration_seconds_count", model="cache-served") == 1
    assert sample("llmgw_router_time_to_first_token_seconds_count", model="cache-served") == 0


def test_loop_histogram_counts_as_prometheus_client_would():
    from prometheus_client import CollectorRegistry, Histogram

    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = metrics.LoopHistogram("h_seconds", "h", ["m"], buckets=(0.1, 1, 5), registry=ours_reg)
    theirs = Histogram("h_seconds", "h", ["m"], buckets=(0.1, 1, 5), registry=theirs_reg)
    for value in (0.05, 0.1, 0.5, 1.0, 1.5, 5.0, 7.0, 0.0):  # bounds themselves included
        ours.labels("a").observe(value)
        theirs.labels("a").observe(value)
    for le in ("0.1", "1.0", "5.0", "+Inf"):
        got = ours_reg.get_sample_value("h_seconds_bucket", {"m": "a", "le": le})
        assert got == theirs_reg.get_sample_value("h_seconds_bucket", {"m": "a", "le": le}), le
    for suffix in ("_count", "_sum"):
        got = ours_reg.get_sample_value("h_seconds" + suffix, {"m": "a"})
        assert got == theirs_reg.get_sample_value("h_seconds" + suffix, {"m": "a"})


def test_loop_counter_refuses_the_wrong_labels_and_counts_per_child():
    import pytest
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    c = metrics.LoopCounter("c_things", "c", ["a", "b"], registry=reg)
    with pytest.raises(ValueError):
        c.labels("only-one")
    c.labels("x", 1).inc()
    c.labels("x", "1").inc(2)  # label values are strings, as in prometheus_client
    c.labels("y", 1).inc()
    assert reg.get_sample_value("c_things_total", {"a": "x", "b": "1"}) == 3
    assert reg.get_sample_value("c_things_total", {"a": "y", "b": "1"}) == 1
    assert reg.get_sample_value("c_things_created", {"a": "x", "b": "1"}) > 0
