"""The status page's chart views, rendered from hand-made data (no scheduler): traffic on
the overview, the capacity map, each model's history and usage per key, project, team."""

from llmgw_scheduler import page
from llmgw_scheduler.history import History, Look
from llmgw_scheduler.traffic import Minute, Traffic
from tests.unit.test_charts import Svg, points
from tests.unit.test_page import GiB, model, node, replica

NOW = 1_800_000_000.0


def charts_of(html: str) -> dict[str, dict]:
    """Each chart's <svg> attributes by its title."""
    return {s["data-title"]: s for s in Svg(html).elements.get("svg", [])}


def traffic() -> Traffic:
    t = Traffic()
    rows = {int(NOW - 600 + 60 * i): {"m": Minute(requests=12, errors=1, ttft_ms_sum=1200.0,
                                                   ttft_n=12, completion_tokens=1200)}
            for i in range(10)}  # fmt: skip
    t.replace(NOW - 3600, rows, NOW)
    return t


def test_the_overview_draws_requests_ttft_and_tokens_per_second_for_each_model():
    html = page.render([node()], [model("m"), model("idle")], [replica()], NOW, traffic=traffic())
    found = charts_of(html)
    assert set(found) == {
        "m: requests per minute", "m: time to first token, ms (mean per minute)",
        "m: completion tokens per second",
    }, "idle had no request: named, not charted"  # fmt: skip
    assert "No requests in the last hour: idle." in html
    svg = Svg(html)
    lines = {p["data-series"]: p for p in svg.elements["polyline"]}
    assert set(lines) >= {"requests", "5xx", "ttft", "tokens/s"}
    requests = [p for p in svg.elements["polyline"] if p["data-series"] == "requests"][0]
    assert len(points(requests)) == 60, "a point a minute over the hour"
    assert "120 requests, 10 errors (8.3%), time to first token 100 ms" in html


def test_the_day_window_draws_ten_minute_points_and_the_links_keep_the_window():
    html = page.render([node()], [model("m")], [], NOW, traffic=traffic(), window="day")
    requests = [p for p in Svg(html).elements["polyline"] if p["data-series"] == "requests"][0]
    assert len(points(requests)) == 144
    assert 'href="/status/capacity?window=day"' in html
    assert 'href="/status"' in html and "<strong>last day</strong>" in html


def test_before_the_first_read_the_overview_says_traffic_is_not_read_yet():
    html = page.render([node()], [model("m")], [], NOW, traffic=None)
    assert "not yet" in html and "polyline" not in html


def test_the_capacity_map_fills_each_node_with_the_replicas_holding_it():
    gpus = [
        {"index": 0, "name": "H100", "uuid": "GPU-0", "memory_total": 80 * GiB,
         "memory_free": 30 * GiB, "model": "m", "replica": "r-1"},
        {"index": 1, "name": "H100", "uuid": "GPU-1", "memory_total": 80 * GiB,
         "memory_free": 80 * GiB, "model": None, "replica": None},
    ]  # fmt: skip
    nodes = [node(gpus=gpus, memory_total=64 * GiB, memory_available=40 * GiB)]
    models = [
        model("m", memory=4 * GiB),
        model("big", state="unplaceable", ready=0, replicas=0, desired=1, memory=200 * GiB,
              reason="gpu-1: needs 200 GiB, has 40 GiB"),
        model("coming", state="starting", ready=0, replicas=1, desired=1),
        model("busy", ready=1, replicas=1, desired=2, memory=GiB,
              desired_reason="cannot scale up: needs 1.0 GiB, largest free 0.5"),
    ]  # fmt: skip
    replicas = [replica(id="r-1", rss=6 * GiB), replica(id="r-2", rss=GiB)]
    html = page.render_capacity(nodes, models, replicas, NOW)
    assert "last day" not in html, "the capacity map is of now"
    found = charts_of(html)
    memory = found["gpu-1 (up): memory"]
    assert memory["data-total"] == str(64 * GiB)
    assert memory["data-used"] == str(24 * GiB), "6 + 4 held, 14 by other use"
    parts = [r for r in Svg(html).elements["rect"] if "data-name" in r]
    assert [(p["data-name"], int(float(p["data-value"]))) for p in parts[:3]] == [
        ("m r-1", 6 * GiB), ("m r-2", 4 * GiB), ("other use", 14 * GiB)
    ], "a replica holds its model's need, or what it uses if more"  # fmt: skip
    assert found["GPU 0 H100"]["data-used"] == str(50 * GiB)
    assert found["GPU 1 H100"]["data-used"] == "0"
    assert "m (r-1)" in html
    rows = page_tables(html)["Waiting, not placed"]
    assert rows == [
        ["big", "unplaceable", "0 of 1", "200 GiB", "gpu-1: needs 200 GiB, has 40 GiB"],
        ["busy", "serving", "1 of 2", "1 GiB", "cannot scale up: needs 1.0 GiB, largest free 0.5"],
    ], "not coming: it is placed and starting"


def test_the_history_view_draws_each_model_s_states_and_lists_its_events():
    h = History()
    h.observe("m", Look("starting", 1, 0), NOW - 1800)
    h.observe("m", Look("serving", 1, 1), NOW - 1200)
    h.observe("m", Look("serving", 2, 1), NOW - 600)
    html = page.render_history(h, ["m"], "hour", NOW)
    strip = charts_of(html)["m: state"]
    assert strip["data-states"] == "starting,serving"
    assert "1 scalings" in html and "scaled 1 → 2" in html and "starting → serving" in html
    steps = charts_of(html)["m: replicas ready and desired"]
    assert steps["data-series"] == "ready,desired"


def test_the_usage_view_ranks_teams_projects_and_keys_by_tokens_in_the_window():
    def rows(by, n):
        return [{by: f"{by}-{i}", "requests": i, "errors": 0, "prompt_tokens": 10 * i,
                 "completion_tokens": 5 * i, "cost": None} for i in range(1, n + 1)]  # fmt: skip

    reports = {(by, "day"): rows(by, 3) for by in ("key", "project", "team")}
    reports[("team", "hour")] = []
    html = page.render_usage(reports, NOW, "day", NOW)
    bars = [r for r in Svg(html).elements["rect"] if "data-name" in r]
    team = [(b["data-name"], b["data-value"]) for b in bars][:3]
    assert team == [("team-3", "45"), ("team-2", "30"), ("team-1", "15")]
    assert set(charts_of(html)) == {
        f"tokens per {by}, last day" for by in ("team", "project", "key")
    }
    hour = page.render_usage(reports, NOW, "hour", NOW)
    assert "No requests in the last hour." in hour


def page_tables(html: str) -> dict:
    from tests.system.test_page import Tables

    return Tables(html).tables
