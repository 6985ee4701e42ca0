"""Small charts as inline SVG, drawn on the server: plain data in, SVG text out.

The status page allows no script and loads nothing from anywhere (its CSP is
`default-src 'none'`), so a chart is markup in the page: a line chart for a series over
time, horizontal bars for a ranking, a strip of coloured spans for a state over time,
and a stacked bar for what fills a node. Every chart carries its title, its axes'
labels, and `data-*` attributes naming what it draws, so a test (or a reader of the
DOM) can check the numbers without reading pixels.

Each function is pure: the same data gives the same SVG. Text is escaped here; model and
key names come from operators.
"""

import math
import time
from dataclasses import dataclass, field
from html import escape

# Colour-blind-safe (Okabe-Ito), then greys; series take them in order.
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#f0e442",
           "#000000", "#6e7781", "#8c6d31")  # fmt: skip
AXIS = "#6e7781"
GRID = "#d0d7de"
TEXT = "#1f2328"
FONT = "font-family:system-ui,sans-serif"

# Room around a line chart's plot for the title, the y labels and the x labels.
TOP, LEFT, RIGHT, BOTTOM = 22, 46, 8, 30


def e(value) -> str:
    return escape(str(value), quote=True)


def short(v: float) -> str:
    """A number in at most four characters or so: 0.25, 12, 3.4k, 1.2M."""
    a = abs(v)
    for unit, per in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if a >= per:
            return f"{v / per:.1f}".removesuffix(".0") + unit
    if a >= 10 or v == int(v):
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.1f}".removesuffix(".0")
    return f"{v:.2f}".rstrip("0").rstrip(".")


def num(v: float) -> str:
    """A number for a data-* attribute, exact: 68719476736, not 6.87195e+10."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """About `n` round numbers from `lo` up to the first at or above `hi`: steps of 1, 2
    or 5 times a power of ten, so an axis reads 0, 50, 100, 150 and not 0, 37.5, 75."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / max(n, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    out, v = [], first
    while True:
        out.append(round(v, 10))
        if v >= hi - 1e-9 * step:
            return out
        v += step


def time_ticks(x0: float, x1: float) -> list[tuple[float, str]]:
    """Round UTC times across (x0, x1), labelled HH:MM: every 10 minutes across an hour,
    every 3 hours across a day."""
    span = x1 - x0
    step = next((s for s in (60, 300, 600, 1800, 3600, 10800, 21600) if span / s <= 7), 43200)
    first = math.ceil(x0 / step) * step
    return [(t, time.strftime("%H:%M", time.gmtime(t))) for t in range(int(first), int(x1) + 1,
            step)]  # fmt: skip


@dataclass(frozen=True)
class Series:
    """One line: (x, y) points in x order; y None is a gap (no data then)."""

    name: str
    points: list[tuple[float, float | None]] = field(default_factory=list)
    colour: str = ""


def _svg(kind: str, title: str, width: int, height: int, body: str, **data) -> str:
    attrs = "".join(f' data-{k.replace("_", "-")}="{e(v)}"' for k, v in data.items())
    return (
        f'<svg class="chart {kind}" role="img" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'data-chart="{kind}" data-title="{e(title)}"{attrs} aria-label="{e(title)}">'
        f"<title>{e(title)}</title>"
        f'<text x="0" y="14" style="{FONT};font-size:12px;font-weight:600" fill="{TEXT}">'
        f"{e(title)}</text>{body}</svg>"
    )


def _label(x: float, y: float, text: str, anchor: str = "start", size: int = 10) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" '
        f'style="{FONT};font-size:{size}px" fill="{AXIS}">{e(text)}</text>'
    )


def line(
    title: str,
    series: list[Series],
    x0: float,
    x1: float,
    unit: str = "",
    width: int = 380,
    height: int = 150,
    empty: str = "no data yet",
) -> str:
    """A line chart of `series` over x0..x1 (Unix times), y from 0 to a round number at
    or above the highest point (`unit` goes in data-unit; the title says it to people).
    With no point at all it says `empty` in the plot instead of drawing a flat line at 0,
    which would be a lie."""
    pw, ph = width - LEFT - RIGHT, height - TOP - BOTTOM
    ys = [y for s in series for _, y in s.points if y is not None]
    top = ticks(0, max(ys))[-1] if ys and max(ys) > 0 else 1.0
    yt = ticks(0, top)

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw if x1 > x0 else LEFT

    def py(y: float) -> float:
        return TOP + ph - y / top * ph

    parts = []
    for v in yt:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{py(v):.1f}" y2="{py(v):.1f}" '
                     f'stroke="{GRID}" stroke-width="1"/>')  # fmt: skip
        parts.append(_label(LEFT - 4, py(v) + 3, short(v), "end"))
    for t, text in time_ticks(x0, x1):
        parts.append(_label(px(t), TOP + ph + 12, text, "middle"))
    parts.append(
        f'<line class="axis" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + ph}" stroke="{AXIS}"/>'
        f'<line class="axis" x1="{LEFT}" x2="{LEFT + pw}" y1="{TOP + ph}" y2="{TOP + ph}" '
        f'stroke="{AXIS}"/>'
    )
    parts.append(_label(LEFT + pw, TOP + ph + 24, "UTC", "end", 9))
    if not ys:
        parts.append(_label(LEFT + pw / 2, TOP + ph / 2, empty, "middle", 11))
    legend_x = LEFT + pw
    for i, s in enumerate(series):
        colour = s.colour or PALETTE[i % len(PALETTE)]
        for run in _runs(s.points):
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            if len(run) == 1:  # a lone point between gaps: a dot, or it would not show
                (x, y), = run  # fmt: skip
                parts.append(f'<circle data-series="{e(s.name)}" cx="{px(x):.1f}" '
                             f'cy="{py(y):.1f}" r="2" fill="{colour}"/>')  # fmt: skip
            else:
                parts.append(f'<polyline data-series="{e(s.name)}" points="{pts}" fill="none" '
                             f'stroke="{colour}" stroke-width="1.5"/>')  # fmt: skip
    # The legend, right-aligned on the title's line; one series is named by the title.
    for s in reversed(series if len(series) > 1 else []):
        colour = s.colour or PALETTE[series.index(s) % len(PALETTE)]
        legend_x -= 7 * len(s.name) + 18
        parts.append(
            f'<rect x="{legend_x:.0f}" y="6" width="8" height="8" fill="{colour}"/>'
            + _label(legend_x + 11, 14, s.name)
        )
    return _svg("line", title, width, height, "".join(parts), unit=unit,
                series=",".join(s.name for s in series))  # fmt: skip


def _runs(points):
    """The points split at gaps (y None)."""
    run = []
    for x, y in points:
        if y is None:
            if run:
                yield run
            run = []
        else:
            run.append((x, y))
    if run:
        yield run


def bars(
    title: str, items: list[tuple[str, float]], unit: str = "", width: int = 380, limit: int = 10
) -> str:
    """Horizontal bars, largest first, at most `limit` (the rest summed as "others"),
    each labelled with its name and value."""
    items = sorted(items, key=lambda kv: (-kv[1], kv[0]))
    if len(items) > limit:
        items = [*items[: limit - 1], ("others", sum(v for _, v in items[limit - 1 :]))]
    row, label_w = 18, 120
    height = TOP + max(len(items), 1) * row + 6
    top = max((v for _, v in items), default=0)
    parts = []
    if not items:
        parts.append(_label(width / 2, TOP + 12, "nothing in this window", "middle", 11))
    plot = width - label_w - 60
    for i, (name, v) in enumerate(items):
        y = TOP + i * row
        w = plot * v / top if top > 0 else 0
        text = name if len(name) <= 18 else name[:17] + "…"
        parts.append(
            _label(label_w - 4, y + 12, text, "end")
            + f'<rect data-name="{e(name)}" data-value="{num(v)}" x="{label_w}" y="{y + 2}" '
            f'width="{w:.1f}" height="{row - 5}" fill="{PALETTE[0]}"/>'
            + _label(label_w + w + 4, y + 12, f"{short(v)} {unit}".strip())
        )
    return _svg("bars", title, width, height, "".join(parts), unit=unit)


def timeline(
    title: str,
    spans: list[tuple[float, float, str]],
    x0: float,
    x1: float,
    colours: dict[str, str],
    width: int = 380,
    height: int = 54,
) -> str:
    """A strip of (start, end, state) spans over x0..x1, each coloured by its state
    (grey for one not in `colours`), with the states shown in a legend."""
    pw = width - LEFT - RIGHT
    strip_y, strip_h = TOP, 14

    def px(x: float) -> float:
        return LEFT + (min(max(x, x0), x1) - x0) / (x1 - x0) * pw if x1 > x0 else LEFT

    parts = [f'<rect x="{LEFT}" y="{strip_y}" width="{pw}" height="{strip_h}" fill="#f6f8fa" '
             f'stroke="{GRID}"/>']  # fmt: skip
    seen: list[str] = []
    for start, end, state in spans:
        if end <= x0 or start >= x1:
            continue
        colour = colours.get(state, AXIS)
        w = max(px(end) - px(start), 1.0)
        parts.append(
            f'<rect data-state="{e(state)}" data-from="{start:.0f}" data-to="{end:.0f}" '
            f'x="{px(start):.1f}" y="{strip_y}" width="{w:.1f}" height="{strip_h}" '
            f'fill="{colour}"><title>{e(state)}</title></rect>'
        )
        if state not in seen:
            seen.append(state)
    for t, text in time_ticks(x0, x1):
        parts.append(_label(px(t), strip_y + strip_h + 11, text, "middle"))
    legend_x = LEFT + pw
    for state in reversed(seen):
        legend_x -= 7 * len(state) + 18
        parts.append(
            f'<rect x="{legend_x:.0f}" y="6" width="8" height="8" '
            f'fill="{colours.get(state, AXIS)}"/>' + _label(legend_x + 11, 14, state)
        )
    return _svg("timeline", title, width, height, "".join(parts),
                states=",".join(seen))  # fmt: skip


def stack(
    title: str,
    total: float,
    parts: list[tuple[str, float, str]],
    label: str = "",
    width: int = 560,
    height: int = 40,
) -> str:
    """One bar of `total`, filled left to right by (name, amount, colour) parts, what is
    left drawn as free; `label` is said after the title (e.g. "3.1 GiB free of 8 GiB").
    Parts that would overflow the total are drawn to its end and no further."""
    bar_y, bar_h, pw = 20, 16, width - 2
    body = [f'<rect class="free" x="1" y="{bar_y}" width="{pw}" height="{bar_h}" fill="#f6f8fa" '
            f'stroke="{GRID}"/>']  # fmt: skip
    x, used = 1.0, 0.0
    for name, amount, colour in parts:
        if total <= 0:
            break
        w = min(amount / total * pw, 1 + pw - x)
        if w <= 0:
            continue
        body.append(
            f'<rect data-name="{e(name)}" data-value="{num(amount)}" x="{x:.1f}" y="{bar_y}" '
            f'width="{w:.1f}" height="{bar_h}" fill="{colour}" stroke="#fff">'
            f"<title>{e(name)}</title></rect>"
        )
        if w > 7 * len(name) + 6:
            body.append(
                f'<text x="{x + 4:.1f}" y="{bar_y + 12}" style="{FONT};font-size:10px" '
                f'fill="#fff">{e(name)}</text>'
            )
        x += w
        used += amount
    if label:
        body.append(_label(width - 2, 14, label, "end"))
    return _svg("stack", title, width, height, "".join(body), total=num(total),
                used=num(used))  # fmt: skip
