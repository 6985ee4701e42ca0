"""The Prometheus metrics the code defines, read from its source (nothing is imported, so
no registry is touched): every prometheus_client constructor called with a literal name
anywhere under tools/ and lib/. Used by the dashboard and metrics-page tests."""

import ast
from dataclasses import dataclass
from functools import cache

from tests.helpers import ROOT

# Constructor -> the suffixes of the series it exposes ("" is the name itself).
# prometheus_client strips a trailing _total from a counter's name and adds it back.
KINDS = {
    "Gauge": ("",),
    "GaugeMetricFamily": ("",),
    "Counter": ("_total", "_created"),
    "CounterMetricFamily": ("_total", "_created"),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "HistogramMetricFamily": ("_bucket", "_sum", "_count", "_created"),
    "LoopCounter": ("_total", "_created"),
    "LoopHistogram": ("_bucket", "_sum", "_count"),
    "Summary": ("", "_sum", "_count", "_created"),
    "SummaryMetricFamily": ("", "_sum", "_count", "_created"),
    "Info": ("_info",),
    "InfoMetricFamily": ("_info",),
    "Enum": ("",),
    "StateSetMetricFamily": ("",),
}


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed: counters with _total
    kind: str  # the constructor
    labels: tuple[str, ...]
    source: str  # file:line, for messages

    def series(self) -> set[str]:
        """Every name this metric's samples carry."""
        base = self.name.removesuffix("_total") if "Counter" in self.kind else self.name
        return {base + suffix for suffix in KINDS[self.kind]}


def _labels(call: ast.Call) -> tuple[str, ...]:
    given = call.args[2] if len(call.args) > 2 else None
    for kw in call.keywords:
        if kw.arg in ("labelnames", "labels"):
            given = kw.value
    if isinstance(given, ast.List | ast.Tuple):
        return tuple(e.value for e in given.elts if isinstance(e, ast.Constant))
    return ()


@cache  # one reading per test run; callers must not change what it returns
def defined() -> dict[str, Metric]:
    """Each metric by its exposed name (a counter's with _total, as in docs and PromQL)."""
    found: dict[str, Metric] = {}
    for path in sorted([*ROOT.glob("tools/**/*.py"), *ROOT.glob("lib/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            first = node.args[0]
            if kind not in KINDS or not isinstance(first, ast.Constant):
                continue
            name = first.value
            if "Counter" in kind:
                name = name.removesuffix("_total") + "_total"
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            found[name] = Metric(name, kind, _labels(node), where)
    return found
