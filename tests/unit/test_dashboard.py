"""dashboards/llmgw.json: valid, laid out, on the datasource variable, and querying only
metrics and labels the code defines, in PromQL that Prometheus' own parser accepts."""

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import ROOT
from tests.metric_names import defined

DASHBOARD = ROOT / "dashboards" / "llmgw.json"
DATASOURCE = "${datasource}"
# Words PromQL reserves between selectors; anything else before no "(" is a metric name.
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
            "group_right", "bool", "offset", "inf", "nan"}  # fmt: skip
# Labels Prometheus itself puts on every scraped series.
TARGET_LABELS = {"job", "instance"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(d: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [
        (f"panel {p['id']} ({p['title']}) {t['refId']}", t["expr"])
        for p in panels(d)
        for t in p.get("targets", [])
    ]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            found = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", q)
            assert found, f"variable {v['name']}: {q!r} is not label_values(metric, label)"
            out.append((f"variable {v['name']}", f"{found.group(1)}{{{found.group(2)}!=''}}"))
    return out


def parts(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], list[set[str]]]:
    """(metric names, (name, labels matched) per selector, labels of each by/without)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    selectors = [
        (name, set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body)))
        for name, body in re.findall(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr)
    ]
    groupings = [
        {label.strip() for label in body.split(",") if label.strip()}
        for body in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
    ]
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = {
        m.group(0)
        for m in re.finditer(r"\b[A-Za-z_:][\w:]*\b(?!\s*\()", bare)
        if m.group(0) not in KEYWORDS
    }
    return names, selectors, groupings


def series() -> dict:
    """Every series name the code exposes -> its metric."""
    return {s: m for m in defined().values() for s in m.series()}


def test_the_dashboard_parses_and_its_panel_ids_are_unique():
    d = dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] == "llmgw"
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    for p in panels(d):
        assert p["type"] == "row" or p.get("targets"), f"panel {p['id']} queries nothing"


def test_no_two_panels_overlap_on_the_grid():
    boxes = [(p["id"], p["gridPos"]) for p in dashboard()["panels"]]
    for i, (a, pa) in enumerate(boxes):
        assert pa["x"] + pa["w"] <= 24, f"panel {a} is wider than the grid"
        for b, pb in boxes[i + 1 :]:
            apart = (
                pa["x"] + pa["w"] <= pb["x"]
                or pb["x"] + pb["w"] <= pa["x"]
                or pa["y"] + pa["h"] <= pb["y"]
                or pb["y"] + pb["h"] <= pa["y"]
            )
            assert apart, f"panels {a} and {b} overlap"


def test_every_metric_and_label_the_dashboard_queries_is_one_the_code_defines():
    known = series()
    assert len(known) > 20, "the code's metrics were not found"
    for where, expr in queries(dashboard()):
        names, selectors, groupings = parts(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - known.keys()
        assert not unknown, f"{where}: {sorted(unknown)} are not defined in tools/ or lib/"
        labels = set(TARGET_LABELS)
        for name in names:
            labels |= set(known[name].labels) | ({"le"} if name.endswith("_bucket") else set())
        for name, matched in selectors:
            extra = matched - TARGET_LABELS - set(known[name].labels) - {"le"}
            assert not extra, f"{where}: {name} has no label {sorted(extra)}"
        for grouping in groupings:
            assert grouping <= labels, f"{where}: grouping by {sorted(grouping - labels)}"


def test_the_parts_of_a_query_are_read_right():
    # The reading above must itself be able to fail.
    names, selectors, groupings = parts(
        'sum by (le) (rate(a_bucket{model=~"$model", x="}"}[5m])) / on (job) b or vector(0)'
    )
    assert names == {"a_bucket", "b"}
    assert selectors == [("a_bucket", {"model", "x"})]
    assert groupings == [{"le"}]


def test_every_datasource_reference_is_the_datasource_variable():
    d = dashboard()
    (variable,) = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert (variable["name"], variable["query"]) == ("datasource", "prometheus")
    refs = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "datasource":
                    refs.append((path, value))
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(d, "$")
    assert len(refs) > 30
    for path, ref in refs:
        assert ref == {"type": "prometheus", "uid": DATASOURCE}, f"{path}: {ref}"
    assert "__inputs" not in d, "an import must not ask for a datasource the variable picks"


def test_the_model_and_node_variables_filter_the_panels_that_have_those_labels():
    d = dashboard()
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "model", "node"} <= names
    known = series()
    for where, expr in queries(d):
        if where.startswith("variable"):
            continue
        for name in parts(expr)[0]:
            for label in ("model", "node"):
                if name in known and label in known[name].labels:
                    assert f'{label}=~"${label}"' in expr, f"{where}: {name} ignores ${label}"


def promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: apt-get install prometheus")
        pytest.skip("promtool is missing (apt-get install prometheus)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


def test_prometheus_parses_every_query(tmp_path):
    """Each query as a recording rule, with Grafana's variables filled in as Grafana does."""
    rules = []
    for i, (where, expr) in enumerate(queries(dashboard())):
        filled = expr.replace("$__rate_interval", "5m")
        filled = filled.replace("$model", ".*").replace("$node", ".*")
        assert "$" not in filled, f"{where}: a variable this test does not fill in"
        rules.append(f"      - record: dashboard:query_{i}\n        expr: {json.dumps(filled)}\n")
    path = tmp_path / "dashboard.rules.yml"
    path.write_text("groups:\n  - name: dashboard\n    rules:\n" + "".join(rules))
    result = promtool("check", "rules", str(path))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert f"SUCCESS: {len(rules)} rules found" in out, out
