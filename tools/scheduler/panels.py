"""The status page's charts, as HTML sections: traffic per model, the capacity map, each
model's history and usage per key, project and team. Pure: plain data in (the admin
API's NODE, MODEL and REPLICA shapes, a Traffic, a History, usage reports), HTML out;
the SVG is charts.py's.
"""

from html import escape

from llmgw.human import size, when
from llmgw_scheduler import charts
from llmgw_scheduler.charts import PALETTE, Series
from llmgw_scheduler.history import History
from llmgw_scheduler.traffic import OTHER, Traffic

# The windows a page can show, and the width of one point of its charts.
WINDOWS = {"hour": (3600, 60), "day": (86400, 600)}

OTHER_USE = "#afb8c1"  # memory in use that no replica holds: the system, other processes
# A state's colour on a history strip: the page's badge colours.
STATE_COLOURS = {
    "serving": "#1a7f37", "starting": "#0969da", "backoff": "#bf8700",
    "parked": "#cf222e", "unplaceable": "#8250df", "stopped": "#afb8c1",
}  # fmt: skip


def e(value) -> str:
    return escape(str(value), quote=True)


def colours(models: list[str]) -> dict[str, str]:
    """One colour per model, the same on every chart of the page."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(sorted(models))}


def _span(window: str, now: float) -> tuple[float, float, int]:
    length, step = WINDOWS[window]
    return now - length, now, step


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


# -- traffic ----------------------------------------------------------------------------


def traffic(t: Traffic | None, names: list[str], window: str, now: float) -> str:
    """Per model (the catalog's, then any other traffic): requests and errors per minute,
    mean time to first token, and completion tokens per second, over the window. Models
    without a request in it are named on one line, not drawn as three flat charts each:
    a catalog of fifty mostly idle models would bury the busy ones."""
    if t is None or t.read_at is None:
        return '<p class="muted">Traffic is read from the usage rows every minute; not yet.</p>'
    x0, x1, step = _span(window, now)
    shown = [*names, *(m for m in t.models() if m not in names)]
    rows, quiet = [], []
    for name in shown:
        total = t.total(name, x0)
        if not total.requests:
            if name != OTHER:
                quiet.append(name)
            continue
        per = f"per {'minute' if step == 60 else f'{step // 60} minutes'}"
        charts_html = (
            charts.line(
                f"{name}: requests per minute",
                [
                    Series("requests", t.series(name, "requests", x0, x1, step), PALETTE[0]),
                    Series("5xx", t.series(name, "errors", x0, x1, step), "#cf222e"),
                    Series("4xx", t.series(name, "client_errors", x0, x1, step), "#bf8700"),
                ],
                x0, x1, unit="req/min",
            )
            + charts.line(
                f"{name}: time to first token, ms (mean {per})",
                [Series("ttft", t.series(name, "ttft_ms", x0, x1, step), PALETTE[2])],
                x0, x1, unit="ms", empty="no streamed requests",
            )
            + charts.line(
                f"{name}: completion tokens per second",
                [Series("tokens/s", t.series(name, "tokens_per_s", x0, x1, step), PALETTE[4])],
                x0, x1, unit="tok/s",
            )
        )  # fmt: skip
        errors = total.errors + total.client_errors
        ttft = total.ttft_ms_sum / total.ttft_n if total.ttft_n else None
        said = (
            f"{total.requests} requests, {errors} errors"
            + (f" ({100 * errors / total.requests:.1f}%)" if total.requests else "")
            + f", time to first token {_ms(ttft)}"
            + f", {total.completion_tokens} completion tokens"
        )
        rows.append(
            f'<div class="model-traffic" data-model="{e(name)}"><h3>{e(name)} '
            f'<span class="muted">{e(said)} in the last {window}</span></h3>'
            f'<div class="charts">{charts_html}</div></div>'
        )
    if quiet:
        rows.append(f'<p class="quiet">No requests in the last {window}: '
                    f"{e(', '.join(quiet))}.</p>")  # fmt: skip
    if not rows:
        return '<p class="muted">No models.</p>'
    return "".join(rows) + (
        f'<p class="muted">From the routers\' usage rows, read {e(when(t.read_at))}.</p>'
    )


# -- capacity -------------------------------------------------------------------------


def capacity(nodes: list[dict], models: list[dict], replicas: list[dict]) -> str:
    """Each node's memory as a bar filled by the replicas that hold it (a replica holds
    its model's need, or what it uses if more), each GPU with the replica assigned it,
    and below, what wants a place and has none."""
    by_model = {m["name"]: m for m in models}
    tone = colours([m["name"] for m in models])
    held: dict[str, list[tuple[str, float, str]]] = {}
    for r in replicas:
        if r["state"] in ("stopped", "failed", "lost"):
            continue
        need = (by_model.get(r["model"]) or {}).get("memory") or 0
        amount = max(need, r.get("rss") or 0)
        held.setdefault(r["node"], []).append(
            (f"{r['model']} {r['id']}", amount, tone.get(r["model"], PALETTE[-1]))
        )
    out = []
    for n in nodes:
        total = n.get("memory_total") or 0
        parts = sorted(held.get(n["name"], []))
        booked = sum(p[1] for p in parts)
        free = n.get("memory_available")
        label = f"{size(int(booked))} held by {len(parts)} replica(s) of {size(total)}; " + (
            "node lost" if free is None else f"the node reports {size(free)} free"
        )
        if free is not None and total - free > booked:  # the system, other processes
            parts.append(("other use", total - free - booked, OTHER_USE))
        bar = charts.stack(f"{n['name']} ({n['state']}): memory", total, parts, label, width=760)
        gpus = []
        for g in sorted(n.get("gpus") or [], key=lambda g: g.get("index", -1)):
            gt = g.get("memory_total") or 0
            used = gt - (g.get("memory_free") or 0) if g.get("memory_free") is not None else gt
            holder = (
                [(g["model"], used, tone.get(g["model"], PALETTE[-1]))] if g.get("model") else []
            )
            gpus.append(charts.stack(
                f"GPU {g.get('index', '?')} {g.get('name', '')}".strip(), gt, holder,
                f"{g['model']} ({g['replica']})" if g.get("replica") else "free", width=370,
            ))  # fmt: skip
        out.append(
            f'<div class="node" data-node="{e(n["name"])}">{bar}'
            + (f'<div class="gpus">{"".join(gpus)}</div>' if gpus else "")
            + "</div>"
        )
    if not out:
        out.append('<p class="muted">No nodes are registered: llmgw nodes add NAME</p>')
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{c}"></span>{e(m)}</span>'
        for m, c in tone.items()
    )
    return (f'<p class="legend">{legend}</p>' if legend else "") + "".join(out)


def waiting(models: list[dict]) -> list[list[str]]:
    """Rows for the models that want more replicas than they have and cannot have them
    now (unplaceable, parked, blocked from scaling up), with what each needs and why."""
    rows = []
    for m in models:
        want = m.get("desired", m.get("min", 0))
        short_of = max(0, want - m.get("replicas", 0))
        if not short_of and m["state"] not in ("unplaceable", "parked"):
            continue
        why = m.get("reason") or m.get("desired_reason") or ""
        if m["state"] not in ("unplaceable", "parked") and not why.startswith("cannot scale up"):
            continue  # on its way: placed and starting
        line = (why.strip().splitlines() or [""])[-1]
        rows.append([
            e(m["name"]), e(m["state"]), e(f"{m.get('replicas', 0)} of {want}"),
            e(size(m.get("memory") or 0)), e(line[:200]),
        ])  # fmt: skip
    return rows


# -- history ----------------------------------------------------------------------------


def history(h: History | None, names: list[str], window: str, now: float) -> str:
    """Per model: a strip of its states over the window, what happened how often, and
    its latest events."""
    if h is None:
        return '<p class="muted">No history kept.</p>'
    x0, x1, _ = _span(window, now)
    out = []
    for name in names:
        strip = charts.timeline(
            f"{name}: state", h.spans(name, x0, x1), x0, x1, STATE_COLOURS, width=560
        )
        steps = charts.line(
            f"{name}: replicas ready and desired",
            [
                Series("ready", h.steps(name, "ready", x0, x1), "#1a7f37"),
                Series("desired", h.steps(name, "desired", x0, x1), "#6e7781"),
            ],
            x0,
            x1,
            width=380,
            height=110,
            empty="not seen in this window",
        )
        counts = h.counts(name, x0)
        said = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        events = h.events(name, x0)[-8:]
        items = "".join(
            f'<li><span class="muted">{e(when(at))}</span> {e(ev)}</li>'
            for at, ev in reversed(events)
        )
        out.append(
            f'<div class="model-history" data-model="{e(name)}"><h3>{e(name)} '
            f'<span class="muted">{e(said)} in the last {window}</span></h3>'
            f'<div class="charts">{strip}{steps}</div>'
            + (f'<ul class="events">{items}</ul>' if items else "")
            + "</div>"
        )
    if not out:
        return '<p class="muted">No models in the catalog.</p>'
    return "".join(out) + (
        '<p class="muted">Kept by this scheduler since it started or took over.</p>'
    )


# -- usage ------------------------------------------------------------------------------


def usage(reports: dict, read_at: float | None, window: str) -> str:
    """Per key, project and team: a bar chart of tokens and a table of the totals."""
    if read_at is None:
        return '<p class="muted">Usage is read from the store every minute; not yet.</p>'
    figures, tables = [], []
    for by in ("team", "project", "key"):
        rows = reports.get((by, window)) or []
        named = [(str(r[by]) if r[by] is not None else "none",
                  r["prompt_tokens"] + r["completion_tokens"]) for r in rows]  # fmt: skip
        figures.append(charts.bars(f"tokens per {by}, last {window}", named, unit="tokens"))
        body = "".join(
            "<tr>"
            + "".join(f"<td>{e(c)}</td>" for c in (
                r[by] if r[by] is not None else "none", r["requests"], r["errors"],
                r["prompt_tokens"], r["completion_tokens"],
                "-" if not r.get("cost") else f"{r['cost']:.4f}"))
            + "</tr>"
            for r in rows[:20]
        )  # fmt: skip
        cols = (by, "requests", "errors", "prompt tokens", "completion tokens", "cost")
        head = "".join(f"<th>{h}</th>" for h in cols)
        tables.append(
            f'<div class="usage" data-by="{by}"><h3>Per {by}</h3>'
            + (
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                if rows
                else f'<p class="muted">No requests in the last {window}.</p>'
            )  # fmt: skip
            + "</div>"
        )
    return (
        f'<div class="charts">{"".join(figures)}</div>'
        + "".join(tables)
        + f'<p class="muted">From the usage rows, read {e(when(read_at))}.</p>'
    )
