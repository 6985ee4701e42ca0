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
