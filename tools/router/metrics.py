"""The router's Prometheus metrics. No key or request id is ever a label.

The ones every request touches (requests, durations, tokens, overhead) are LoopCounter
and LoopHistogram: plain numbers the event loop adds to, read when /metrics is scraped.
prometheus_client's own take a lock and check their state on every update, about 1.5 µs
each, and a request made six (issue #12's profile); these cost a tenth of that. They are
updated and scraped on the event loop only, so they need no lock.
"""

import bisect
import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Spans the exporter sent, dropped or failed to send (llmgw.tracing): on this page too.
from llmgw.tracing import EXPORT_FAILURES, SPANS_DROPPED, SPANS_EXPORTED  # noqa: F401


class _Family:
    """A metric's children by label values, made on first use; registered to be read at
    scrape time (collect, describe)."""

    kind = None  # the prometheus_client family class it is exposed as

    def __init__(self, name: str, documentation: str, labelnames):
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple, object] = {}

    def labels(self, *values):
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: want labels {self.labelnames}, got {key}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._child()
        return child

    def _child(self):
        raise NotImplementedError

    def describe(self):
        yield self.kind(self.name, self.documentation, labels=self.labelnames)


class _Count:
    __slots__ = ("value", "created")

    def __init__(self):
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounter(_Family):
    """A counter updated on the event loop without a lock; as prometheus_client's
    Counter exposes it (NAME_total, NAME_created)."""

    kind = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labelnames=(), registry=REGISTRY):
        super().__init__(name.removesuffix("_total"), documentation, labelnames)
        if registry is not None:
            registry.register(self)

    def _child(self) -> _Count:
        return _Count()

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            family.add_metric(key, child.value, created=child.created)
        yield family


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: over every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # A bucket counts values <= its bound: the first bound not below the value.
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopHistogram(_Family):
    """A histogram updated on the event loop without a lock; exposed as
    prometheus_client's Histogram is (NAME_bucket, NAME_sum, NAME_count)."""

    kind = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames=(), buckets=(),
                 registry=REGISTRY):  # fmt: skip
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(float(b) for b in buckets if b != float("inf"))
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds:
            raise ValueError(f"{name}: buckets must be increasing")
        self._one = None if self.labelnames else self.labels()
        if registry is not None:
            registry.register(self)

    def _child(self) -> _Buckets:
        return _Buckets(self.bounds)

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self._one.observe(value)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum
            running, buckets = 0, []
            for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
                running += n
                buckets.append((floatToGoString(bound), running))
            family.add_metric(key, buckets, total)
        yield family


_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = LoopCounter(
    "llmgw_router_requests", "Requests answered, by model and HTTP status", ["model", "status"]
)
API_REQUESTS = LoopCounter(
    "llmgw_router_api_requests",
    "Requests answered, by the API path they came by and HTTP status",
    ["api", "status"],
)
DURATION = LoopHistogram(
    "llmgw_router_request_duration_seconds",
    "Whole request, first byte in to last byte out",
    ["model"],
    buckets=_LATENCY,
)
TTFT = LoopHistogram(
    "llmgw_router_time_to_first_token_seconds",
    "Streamed requests: time to the first token",
    ["model"],
    buckets=_LATENCY,
)
TOKENS = LoopCounter(
    "llmgw_router_tokens", "Tokens by model and kind (prompt, completion)", ["model", "kind"]
)
IN_FLIGHT = Gauge("llmgw_router_in_flight_requests", "Requests being answered now")
CONNECTIONS = Gauge("llmgw_router_client_connections", "Client connections open now (http1)")
UPSTREAM_ERRORS = Counter(
    "llmgw_router_upstream_errors",
    "Failures talking to an engine, by endpoint and kind",
    ["endpoint", "kind"],
)
OVERHEAD = LoopHistogram(
    "llmgw_router_overhead_seconds",
    "Time the router itself spends on a request, excluding waiting for the engine",
    buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
USAGE_DROPPED = Counter(
    "llmgw_router_usage_rows_dropped", "Usage rows dropped because the write buffer was full"
)
USAGE_SPOOL_ERRORS = Counter(
    "llmgw_router_usage_spool_errors",
    "Usage rows the spool could not take (unwritable directory, full disk); they wait in memory",
)
TABLE_AGE = Gauge(
    "llmgw_router_table_age_seconds",
    "Seconds since a scheduler last sent this router a routing table (since its start if"
    " none has); 0 for a router without schedulers",
)
CONTROL_PLANE_UNREACHABLE = Counter(
    "llmgw_router_control_plane_unreachable",
    "Requests for a model with no ready replica that could not be started, the schedulers"
    " being silent: answered 503 control_plane_unreachable at once (unless a fallback"
    " answered), by model",
    ["model"],
)
USAGE_PENDING = Gauge("llmgw_router_usage_rows_pending", "Usage rows waiting to be written")
KEYS_LOADED = Gauge("llmgw_router_api_keys", "API keys held in memory")
LEASE_FAILURES = Counter(
    "llmgw_router_lease_failures",
    "Failed attempts to lease allowance from the store (limits, budgets, concurrency)",
)
LIMITED = Counter(
    "llmgw_router_limit_rejections",
    "Requests refused by a limit: kind rpm, tpm or concurrent (429 rate_limit_exceeded)",
    ["kind"],
)
BUDGET_REJECTIONS = Counter(
    "llmgw_router_budget_rejections",
    "Requests refused because a budget was spent (429 insufficient_quota), by budget kind",
    ["kind"],
)
LIMITS_UNAVAILABLE = Counter(
    "llmgw_router_limits_unavailable",
    "Requests refused 503 because more allowance could not be leased (store unreachable)",
)
QUEUE_DEPTH = Gauge(
    "llmgw_router_queue_depth",
    "Requests waiting for a saturated model, by model and band",
    ["model", "band"],
)
QUEUE_WAIT = Histogram(
    "llmgw_router_queue_wait_seconds",
    "How long queued requests waited for a slot, admitted or not, by band",
    ["band"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
QUEUE_REJECTIONS = Counter(
    "llmgw_router_queue_rejections",
    "Requests whose queue deadline passed before a slot was free, by band",
    ["band"],
)
FALLBACKS = Counter(
    "llmgw_router_fallbacks",
    "Requests sent to a fallback model, by requested model, fallback and reason",
    ["model", "fallback", "reason"],
)


# -- children looked up once ------------------------------------------------------------
# A labels() call builds a tuple and looks it up, a dict hit costs less; the request
# path made six a request. Its label values are few (served models,
# statuses, API paths), as for the metric itself, so the caches are as bounded as the
# series are.


class ModelMetrics:
    """The children of one served model's per-model metrics."""

    __slots__ = ("duration", "ttft", "prompt_tokens", "completion_tokens")

    def __init__(self, model: str):
        self.duration = DURATION.labels(model)
        self.ttft = TTFT.labels(model)
        self.prompt_tokens = TOKENS.labels(model, "prompt")
        self.completion_tokens = TOKENS.labels(model, "completion")


_by_model: dict[str, ModelMetrics] = {}
_requests: dict[tuple[str, int], object] = {}
_api_requests: dict[tuple[str, int], object] = {}


def of_model(model: str) -> ModelMetrics:
    m = _by_model.get(model)
    if m is None:
        m = _by_model[model] = ModelMetrics(model)
    return m


def requests(model: str, status: int):
    """REQUESTS's child for (model, status)."""
    child = _requests.get((model, status))
    if child is None:
        child = _requests[(model, status)] = REQUESTS.labels(model, str(status))
    return child


def api_requests(api: str, status: int):
    """API_REQUESTS's child for (api path, status)."""
    child = _api_requests.get((api, status))
    if child is None:
        child = _api_requests[(api, status)] = API_REQUESTS.labels(api, str(status))
    return child


PREFIX_PREDICTED = Counter(
    "llmgw_router_prefix_predicted_cached_tokens",
    "Prompt tokens prefix routing expected the chosen engine to have cached, by model",
    ["model"],
)
PREFIX_CACHED = Counter(
    "llmgw_router_prefix_cached_tokens",
    "Prompt tokens the engine said it reused from its cache (prefix routing), by model",
    ["model"],
)
PREFIX_PROMPT = Counter(
    "llmgw_router_prefix_prompt_tokens",
    "Prompt tokens of requests routed by prefix whose engine said what it cached, by model",
    ["model"],
)
PREFIX_DROPS = Counter(
    "llmgw_router_prefix_chain_drops",
    "Prefix chains forgotten for a replica because its engine cached far less than predicted",
    ["model"],
)
PREFIX_HIT_RATIO = Gauge(
    "llmgw_router_prefix_hit_ratio",
    "Share of prompt tokens the engines reused from their caches since start, by model",
    ["model"],
)
PREFIX_HOLDS = Counter(
    "llmgw_router_prefix_holds",
    "Requests that waited for another to finish evaluating the prompt they share on the "
    "same replica, rather than evaluate it again beside it (prefix routing), by model",
    ["model"],
)
PREFIX_HOLD_SECONDS = Counter(
    "llmgw_router_prefix_hold_seconds",
    "Seconds requests waited for another's prompt evaluation (prefix routing), by model",
    ["model"],
)
_prefix_sums: dict[str, list[int]] = {}


def prefix_held(model: str, seconds: float) -> None:
    """A request waited `seconds` for another's prompt on its replica (prefix.hold)."""
    PREFIX_HOLDS.labels(model).inc()
    PREFIX_HOLD_SECONDS.labels(model).inc(seconds)


def prefix_observed(model: str, outcome, prompt_tokens: int) -> None:
    """One request routed by prefix ended; `outcome` is prefix.Outcome."""
    if outcome.actual < 0 or prompt_tokens <= 0:
        return  # the engine did not say what it cached: nothing to compare
    PREFIX_PREDICTED.labels(model).inc(outcome.predicted)
    PREFIX_CACHED.labels(model).inc(outcome.actual)
    PREFIX_PROMPT.labels(model).inc(prompt_tokens)
    if outcome.dropped:
        PREFIX_DROPS.labels(model).inc()
    sums = _prefix_sums.setdefault(model, [0, 0])
    sums[0] += outcome.actual
    sums[1] += prompt_tokens
    PREFIX_HIT_RATIO.labels(model).set(sums[0] / sums[1])


PREFIX_SHARED = Counter(
    "llmgw_router_prefix_shared_messages",
    "Prefix routing's messages to and from peer routers (router.prefix_peers): sent, "
    "heard, dropped (this router's queue was full) and malformed",
    ["what"],
)
_prefix_shared = {w: PREFIX_SHARED.labels(w) for w in ("sent", "heard", "dropped", "malformed")}


def prefix_shared(what: str, n: int) -> None:
    """Count `n` of prefix routing's messages to or from peers (share.py)."""
    _prefix_shared[what].inc(n)
