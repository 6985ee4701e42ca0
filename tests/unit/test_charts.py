"""The status page's SVG charts: where points land, how axes are scaled, and what an
empty chart says, read back from the SVG text."""

import re
from html.parser import HTMLParser

from llmgw_scheduler import charts
from llmgw_scheduler.charts import BOTTOM, LEFT, RIGHT, TOP, Series

T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


class Svg(HTMLParser):
    """Each element's attributes, by tag, and the text of every <text>."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: dict[str, list[dict]] = {}
        self.texts: list[str] = []
        self._in_text = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.setdefault(tag, []).append(dict(attrs))
        self._in_text = tag == "text"

    def handle_endtag(self, tag):
        self._in_text = False

    def handle_data(self, data):
        if self._in_text:
            self.texts.append(data)


def points(polyline: dict) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in polyline["points"].split()]


def test_a_line_chart_puts_the_first_and_last_points_at_the_plot_edges_and_the_peak_on_top():
    width, height = 400, 160
    s = Series("requests", [(T0, 0.0), (T0 + 1800, 50.0), (T0 + 3600, 100.0)])
    svg = Svg(charts.line("requests per minute", [s], T0, T0 + 3600, width=width, height=height))
    (line,) = svg.elements["polyline"]
    assert line["data-series"] == "requests"
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM
    assert points(line) == [
        (LEFT, TOP + plot_h),  # 0 on the x axis
        (LEFT + plot_w / 2, TOP + plot_h / 2),
        (LEFT + plot_w, TOP),  # 100: the axis' top, a round number
    ]
    assert svg.elements["svg"][0]["data-title"] == "requests per minute"
    assert "requests per minute" in svg.texts


def test_the_y_axis_tops_out_at_a_round_number_above_the_peak_with_round_ticks():
    svg = Svg(charts.line("t", [Series("a", [(T0, 37.0), (T0 + 60, 12.0)])], T0, T0 + 3600))
    labels = [t for t in svg.texts if re.fullmatch(r"[\d.]+k?", t)]
    assert labels[:5] == ["0", "10", "20", "30", "40"], labels
    (line,) = svg.elements["polyline"]
    tops = [y for _, y in points(line)]
    assert min(tops) > TOP, "37 sits below the top tick, 40"


def test_the_x_axis_is_labelled_in_utc_every_ten_minutes_across_an_hour():
    svg = Svg(charts.line("t", [Series("a", [(T0, 1.0)])], T0, T0 + 3600))
    times = [t for t in svg.texts if re.fullmatch(r"\d\d:\d\d", t)]
    assert times == ["08:00", "08:10", "08:20", "08:30", "08:40", "08:50", "09:00"]
    assert "UTC" in svg.texts


def test_a_gap_splits_the_line_and_a_lone_point_is_drawn_as_a_dot():
    s = Series("ttft", [(T0, 100.0), (T0 + 60, 120.0), (T0 + 120, None), (T0 + 180, 90.0)])
    svg = Svg(charts.line("t", [s], T0, T0 + 3600))
    assert len(svg.elements["polyline"]) == 1
    assert len(points(svg.elements["polyline"][0])) == 2
    (dot,) = svg.elements["circle"]
    assert dot["data-series"] == "ttft"


def test_a_chart_with_no_data_says_so_and_draws_no_line():
    empty = Series("requests", [])
    gaps = Series("ttft", [(T0, None), (T0 + 60, None)])
    svg = Svg(charts.line("t", [empty, gaps], T0, T0 + 3600, empty="no streamed requests"))
    assert "polyline" not in svg.elements and "circle" not in svg.elements
    assert "no streamed requests" in svg.texts


def test_every_series_gets_a_legend_entry_and_its_own_colour():
    a, b = Series("requests", [(T0, 1.0)] * 2), Series("5xx", [(T0, 0.0)] * 2)
    svg = Svg(charts.line("t", [a, b], T0, T0 + 3600))
    assert {"requests", "5xx"} <= set(svg.texts)
    strokes = [p["stroke"] for p in svg.elements["polyline"]]
    assert len(set(strokes)) == 2
    assert svg.elements["svg"][0]["data-series"] == "requests,5xx"
    alone = Svg(charts.line("ttft", [Series("ttft", [(T0, 1.0)] * 2)], T0, T0 + 3600))
    assert "ttft" not in alone.texts[1:], "one series: the title names it, no legend"


def test_names_in_a_chart_are_escaped():
    text = charts.line("<b>m</b>", [Series("<script>", [(T0, 1.0)] * 2)], T0, T0 + 60)
    assert "<script>" not in text and "<b>" not in text
    assert "&lt;script&gt;" in text


def test_ticks_step_by_one_two_or_five_times_a_power_of_ten():
    assert charts.ticks(0, 100) == [0, 50, 100]
    assert charts.ticks(0, 37) == [0, 10, 20, 30, 40]
    assert charts.ticks(0, 0.7) == [0, 0.2, 0.4, 0.6, 0.8]
    assert charts.ticks(0, 0) == [0, 0.5, 1]


def test_bars_come_largest_first_with_widths_in_proportion_and_the_tail_summed():
    items = [(f"team-{i}", float(i)) for i in range(1, 13)]
    svg = Svg(charts.bars("tokens per team", items, unit="tokens", limit=5))
    rects = svg.elements["rect"]
    assert [r["data-name"] for r in rects] == ["team-12", "team-11", "team-10", "team-9", "others"]
    assert float(rects[-1]["data-value"]) == sum(range(1, 9))
    widths = {r["data-name"]: float(r["width"]) for r in rects}
    assert widths["others"] == max(widths.values()), "36 is the largest"
    assert abs(widths["team-12"] / widths["others"] - 12 / 36) < 0.01


def test_bars_with_nothing_say_so():
    svg = Svg(charts.bars("tokens per key", []))
    assert "rect" not in svg.elements
    assert "nothing in this window" in svg.texts


def test_a_timeline_draws_each_span_in_its_state_colour_clipped_to_the_window():
    spans = [(T0 - 600, T0 + 600, "starting"), (T0 + 600, T0 + 3600, "serving")]
    colours = {"starting": "#0969da", "serving": "#1a7f37"}
    svg = Svg(charts.timeline("m: state", spans, T0, T0 + 3600, colours, width=400))
    drawn = [r for r in svg.elements["rect"] if "data-state" in r]
    assert [(r["data-state"], r["fill"]) for r in drawn] == [
        ("starting", "#0969da"), ("serving", "#1a7f37")
    ]  # fmt: skip
    plot = 400 - LEFT - RIGHT
    assert float(drawn[0]["x"]) == LEFT, "clipped at the window's start"
    assert abs(float(drawn[0]["width"]) - plot / 6) < 0.2
    assert svg.elements["svg"][0]["data-states"] == "starting,serving"


def test_a_stack_fills_in_order_and_stops_at_the_total():
    parts = [("a r-1", 6.0, "#111111"), ("b r-2", 3.0, "#222222"), ("c r-3", 5.0, "#333333")]
    svg = Svg(charts.stack("node memory", 10.0, parts, width=102))
    drawn = [r for r in svg.elements["rect"] if "data-name" in r]
    assert [float(r["width"]) for r in drawn] == [60.0, 30.0, 10.0], "c is cut at the end"
    assert [float(r["x"]) for r in drawn] == [1.0, 61.0, 91.0]
    assert svg.elements["svg"][0]["data-used"] == "14"
