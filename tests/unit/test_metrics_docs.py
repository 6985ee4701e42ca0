"""docs/metrics.md names every metric the code defines, with its type and labels, and
every alert in alerts/llmgw.rules.yml; and names nothing that does not exist."""

import re

import pytest

from tests.helpers import ROOT
from tests.metric_names import defined

PAGE = ROOT / "docs" / "metrics.md"
RULES = ROOT / "alerts" / "llmgw.rules.yml"
TYPES = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary"}


def type_of(kind: str) -> str | None:
    """The Prometheus type a constructor makes: Counter, CounterMetricFamily and the
    router's LoopCounter all make a counter."""
    return next((t for k, t in TYPES.items() if k in kind), None)


def rows() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the page's tables: `| \\`a\\` / \\`b\\` | type | labels |`."""
    out = {}
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`(llmgw_\w+)`", cells[0]) if len(cells) >= 3 else []
        for name in names:
            labels = {label.strip() for label in cells[2].split(",") if label.strip()}
            out[name] = (cells[1], labels)
    return out


def alerts() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.M)


@pytest.mark.parametrize("name", sorted(defined()))
def test_every_metric_is_in_the_metrics_page_with_its_type_and_labels(name):
    metric = defined()[name]
    documented = rows()
    assert name in documented, f"{name} ({metric.source}) has no row in docs/metrics.md"
    assert documented[name] == (type_of(metric.kind), set(metric.labels)), (
        f"{name}: {metric.source} says"
    )


def test_every_alert_is_named_in_the_metrics_page():
    text = PAGE.read_text()
    assert len(alerts()) > 10
    missing = [a for a in alerts() if f"`{a}`" not in text]
    assert not missing, f"docs/metrics.md does not name {missing}"


def test_the_metrics_page_names_no_metric_the_code_does_not_define():
    # A histogram is documented by its name; PromQL in the page may name its series.
    known = set(defined()) | {s for m in defined().values() for s in m.series()}
    named = set(re.findall(r"`(llmgw_\w+?)(?:\{[^`]*)?`", PAGE.read_text()))
    assert named, "no metric names found in docs/metrics.md"
    assert named - known == set(), "renamed or removed metrics are still documented"


def test_reading_the_source_finds_what_prometheus_client_registers():
    """The source reading above against the real registry, for the modules that register
    at import (certmon's collector registers only when serving)."""
    import prometheus_client

    import llmgw_agentd.metrics  # noqa: F401
    import llmgw_router.metrics  # noqa: F401
    import llmgw_scheduler.metrics  # noqa: F401

    # Collectors that make their families at scrape time register when their tool starts
    # serving (a router's engine probe, certmon), in this process only if a test did.
    families = {m.name for m in defined().values() if "Family" in m.kind}
    registered = {
        (f.name + ("_total" if f.type == "counter" else ""), f.type)
        for f in prometheus_client.REGISTRY.collect()
        if f.name.startswith("llmgw_") and f.name not in families
    }
    read = {
        (m.name, type_of(m.kind))
        for m in defined().values()
        if "certmon" not in m.source and "Family" not in m.kind
    }
    assert registered == read
