"""llmgw.tracing: off unless configured, spans to a real OTLP receiver, and a collector
that is down or behind costs counters, not the caller's time."""

import pytest
from prometheus_client import REGISTRY

from llmgw import config, tracing
from llmgw.errors import ConfigError
from tests.helpers import eventually, free_port
from tests.otlp_receiver import Receiver

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"


def counted(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture(autouse=True)
def off_after():
    yield
    tracing.shutdown()


def test_without_an_endpoint_tracing_stays_off_and_spans_are_one_shared_no_op():
    assert tracing.setup(config.TracingConfig(), "llmgw-scheduler") is False
    assert tracing.tracer is None
    with tracing.span("llmgw.placement_pass") as span:
        span.set_attribute("llmgw.starts", 1)
    assert span is tracing.OFF and not span.is_recording()


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("endpoint", "collector:4317", "want http://HOST:PORT"),
        ("sample_rate", 1.5, "must be from 0 to 1"),
        ("queue_size", 0, "must be above 0"),
    ],
)
def test_a_bad_tracing_setting_is_refused_naming_the_key(key, value, says):
    cfg = config.TracingConfig(endpoint="http://collector:4317")
    setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=f"tracing.{key} = .*{says}"):
        tracing.setup(cfg, "llmgw-router")
    assert tracing.tracer is None


def test_a_span_reaches_the_collector_as_the_child_of_its_callers_traceparent(receiver):
    cfg = config.TracingConfig(endpoint=receiver.endpoint, sample_rate=0.0, service_name="edge")
    assert tracing.setup(cfg, "llmgw-scheduler")
    exported = counted("llmgw_tracing_spans_exported_total")
    headers = {"traceparent": f"00-{TRACE}-{CALLER}-01"}
    with tracing.span("GET /v1/models", headers, server=True) as span:
        span.set_attribute("http.response.status_code", 200)
    (got,) = receiver.wait(lambda r: r.trace(TRACE), what="the span")
    assert (got.parent_id, got.kind, got.service) == (CALLER, "SERVER", "edge")
    assert got.resource["service.namespace"] == "llmgw"
    assert got.attributes == {"http.response.status_code": 200}
    eventually(lambda: counted("llmgw_tracing_spans_exported_total") == exported + 1)


def test_with_the_collector_down_spans_end_at_once_and_are_dropped_and_counted():
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = config.TracingConfig(endpoint=dead, sample_rate=1.0, queue_size=4)
    tracing.setup(cfg, "llmgw-router")
    full = counted("llmgw_tracing_spans_dropped_total", reason="queue_full")
    failed = counted("llmgw_tracing_spans_dropped_total", reason="export_failed")
    batches = counted("llmgw_tracing_export_failures_total")
    for _ in range(50):  # far more than the queue holds; none of them waits for it
        with tracing.span("llmgw.placement_pass"):
            pass
    assert counted("llmgw_tracing_spans_dropped_total", reason="queue_full") >= full + 40
    eventually(
        lambda: counted("llmgw_tracing_export_failures_total") > batches,
        timeout=15,
        what="the failed export to be counted",
    )
    assert counted("llmgw_tracing_spans_dropped_total", reason="export_failed") > failed


@pytest.mark.parametrize(
    "header",
    [
        f"00-{TRACE}-{CALLER}",  # no flags
        f"00-{TRACE.upper()}-{CALLER}-01",  # W3C says lower case
        f"ff-{TRACE}-{CALLER}-01",  # the version that is never valid
        f"00-{TRACE}-{CALLER}-01-more",  # version 00 has four fields
        f"00-{'0' * 32}-{CALLER}-01",  # an all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # an all-zero parent id
    ],
)
def test_a_traceparent_that_is_not_w3c_trace_context_is_ignored_and_the_span_is_a_root(
    receiver, header
):
    tracing.setup(config.TracingConfig(endpoint=receiver.endpoint, sample_rate=1.0), "x")
    assert tracing.parent({"traceparent": header}) is None
    with tracing.span("GET /v1/models", {"traceparent": header}, server=True) as span:
        pass
    assert span.trace_id != int(TRACE, 16) and span.parent_id == 0


def test_a_callers_trace_state_goes_on_with_its_trace_and_a_later_version_is_read():
    cfg = config.TracingConfig(endpoint="http://127.0.0.1:9", sample_rate=0.0)
    tracing.setup(cfg, "llmgw-router")
    headers = {"traceparent": f"01-{TRACE}-{CALLER}-01-later", "tracestate": "a=1 , b=2,,"}
    caller = tracing.parent(headers)
    span = tracing.start("chat", tracing.SERVER, caller)
    assert (span.trace_id, span.parent_id, span.trace_state) == (
        int(TRACE, 16),
        int(CALLER, 16),
        "a=1,b=2",
    )
    child = tracing.child(span, "llmgw.attempt", tracing.CLIENT)
    assert tracing.traceparent(child) == f"00-{TRACE}-{child.span_id:016x}-01"
    assert child.trace_state == "a=1,b=2"


def test_an_exception_that_leaves_a_span_is_recorded_on_it_as_an_error(receiver):
    tracing.setup(config.TracingConfig(endpoint=receiver.endpoint, sample_rate=1.0), "x")
    with (
        pytest.raises(KeyError),
        tracing.span("POST /v1/models", {"traceparent": f"00-{TRACE}-{CALLER}-01"}),
    ):
        raise KeyError("m")
    (got,) = receiver.wait(lambda r: r.trace(TRACE), what="the span")
    assert got.status == 2
    ((name, attrs),) = got.events
    assert name == "exception"
    assert attrs["exception.type"] == "KeyError" and attrs["exception.message"] == "'m'"
    assert "raise KeyError" in attrs["exception.stacktrace"]
