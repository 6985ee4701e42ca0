"""The status page's charts with a real cluster: the fake engine serving through the
router, streamed traffic from a key in a team and a project, a model that fits nowhere.
Read as HTML, then drawn by headless Chromium: the SVG is in the browser's DOM with the
series the page says, and the screenshots have the charts' colours where the charts are.

LLMGW_SCREENSHOTS=DIR keeps the screenshots there; docs/status-*.png were made so, with
LLMGW_SCREENSHOTS_TRAFFIC_S=300 (and --timeout=900) for five more minutes of traffic."""

import json
import os
import re
import shutil
import subprocess
import threading

import requests

from llmgw_scheduler.charts import PALETTE
from tests.helpers import eventually
from tests.system.conftest import GiB
from tests.system.test_page import chromium, read_png, token, url
from tests.unit.test_charts import Svg, points


def ok(cluster, *args):
    result = cluster.ctl(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if "--json" in args else result


def charts(html: str) -> dict[str, Svg]:
    """Each <svg> chart of a page, parsed, by its title."""
    out = {}
    for chunk in html.split("<svg")[1:]:
        svg = Svg("<svg" + chunk.split("</svg>")[0] + "</svg>")
        out[svg.elements["svg"][0]["data-title"]] = svg
    return out


def drawn(svg: Svg, series: str) -> list[tuple[float, float]]:
    """The points of `series` in a line chart: its polylines' and its dots'."""
    out = []
    for line in svg.elements.get("polyline", []):
        if line["data-series"] == series:
            out += points(line)
    for dot in svg.elements.get("circle", []):
        if dot["data-series"] == series:
            out.append((float(dot["cx"]), float(dot["cy"])))
    return out


def above_zero(svg: Svg, series: str) -> bool:
    """Whether any point of `series` is above the x axis (the plot's bottom)."""
    height = float(svg.elements["svg"][0]["height"])
    bottom = height - 30  # charts.BOTTOM
    return any(y < bottom - 0.5 for _, y in drawn(svg, series))


class Streams:
    """Streamed chat requests for `model` with `secret`, one after another, and now and
    then one for a model that does not exist (a 404 in the usage rows)."""

    def __init__(self, cluster, secret: str):
        self.cluster, self.secret, self.sent = cluster, secret, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            model = "nope" if self.sent % 10 == 9 else "m"
            try:
                with requests.post(
                    f"{self.cluster.router_url}/v1/chat/completions",
                    json={"model": model, "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {self.secret}"}, stream=True, timeout=10,
                ) as r:  # fmt: skip
                    for _ in r.iter_lines():
                        pass
            except requests.RequestException:
                pass
            self.sent += 1
            # Busier and quieter by turns, so a longer run (LLMGW_SCREENSHOTS_TRAFFIC_S)
            # draws a line that moves.
            self._stop.wait(0.05 + 0.1 * (self.sent // 200 % 3))

    def stop(self):
        self._stop.set()
        self._thread.join()


def page(cluster, path: str) -> str:
    r = requests.get(url(cluster, path), headers={"Authorization": f"Bearer {token(cluster)}"},
                     timeout=10)  # fmt: skip
    assert r.status_code == 200, r.text[:300]
    return r.text


def shoot(target: str, out, tmp_path, height: int) -> subprocess.CompletedProcess:
    """Chromium's screenshot of `target` (a URL), or its DOM when `out` is None."""
    args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium'}", f"--window-size=1280,{height}"]  # fmt: skip
    args += [f"--screenshot={out}"] if out else ["--dump-dom"]
    result = subprocess.run([*args, target], capture_output=True, text=True, timeout=120)
    if out:
        assert out.exists(), f"no screenshot ({result.returncode}): {result.stderr}"
    return result


def browse(cluster, path: str, tmp_path, shot: str | None = None, height: int = 1000) -> str:
    """Chromium's DOM of `path` after trading ?token= for the cookie (and a screenshot)."""
    sep = "&" if "?" in path else "?"
    target = url(cluster, f"{path}{sep}token={token(cluster)}")
    return shoot(target, tmp_path / shot if shot else None, tmp_path, height).stdout


def differing(a: bytes, b: bytes) -> int:
    """Pixels that differ between two screenshots of one size."""
    wa, ha, ra = read_png(a)
    wb, hb, rb = read_png(b)
    assert (wa, ha) == (wb, hb)
    return sum(
        1
        for x, y in zip(ra, rb, strict=True)
        for i in range(0, len(x), 3)
        if x[i : i + 3] != y[i : i + 3]
    )


def pixels_of(png: bytes, colour: str) -> int:
    """Pixels of `colour` drawn on white, antialiased edges included: each channel the
    same share of the way from white to the colour (a grid line's grey or another
    series' colour is not), at least a third of the way."""
    _, _, rows = read_png(png)
    want = bytes.fromhex(colour.lstrip("#"))
    span = [255 - c for c in want]
    n = 0
    for row in rows:
        for i in range(0, len(row), 3):
            shares = [(255 - p) / s for p, s in zip(row[i : i + 3], span, strict=True) if s > 40]
            if min(shares) >= 0.33 and max(shares) - min(shares) <= 0.15:
                n += 1
    return n


def test_the_charts_show_a_cluster_s_traffic_capacity_history_and_usage_in_chromium(
    cluster, tmp_path
):
    cluster.add_model("m", memory=GiB)
    cluster.add_model("big", memory=8 * GiB)  # no node has 8 GiB: it waits, unplaced
    cluster.scheduler_extra = "status_refresh_s = 1.0\n"
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_agent("node-b", memory=GiB // 2)
    ok(cluster, "orgs", "create", "acme")
    ok(cluster, "teams", "create", "research", "--org", "acme")
    ok(cluster, "users", "create", "ada@acme.org", "--team", "research")
    ok(cluster, "projects", "create", "bot", "--org", "acme")
    key = ok(cluster, "keys", "create", "--name", "bot", "--user", "ada@acme.org",
             "--project", "bot", "--json")  # fmt: skip
    cluster.start_router(key["secret"])
    eventually(lambda: cluster.serves("m"), timeout=30, what="model m to be served")

    traffic = Streams(cluster, key["secret"])
    try:
        # A minute is charted once it is over: traffic runs into a second minute.
        def charted():
            found = charts(page(cluster, "/status"))
            c = found.get("m: requests per minute")
            return found if c is not None and above_zero(c, "requests") else None

        overview = eventually(charted, timeout=150, what="m's requests charted")
        longer = float(os.environ.get("LLMGW_SCREENSHOTS_TRAFFIC_S") or 0)
        if longer:  # for the docs' screenshots: more minutes on the charts
            threading.Event().wait(longer)
            overview = charted()
    finally:
        traffic.stop()
    assert traffic.sent > 20

    # -- the overview: m's three charts, (other) for the 404s, big named as quiet -------
    assert above_zero(overview["m: time to first token, ms (mean per minute)"], "ttft")
    assert above_zero(overview["m: completion tokens per second"], "tokens/s")
    other = overview["(other): requests per minute"]
    assert above_zero(other, "4xx"), "the requests for 'nope' are 404s"
    assert not [title for title in overview if title.startswith("big:")]
    assert "No requests in the last hour: big." in page(cluster, "/status")
    day = charts(page(cluster, "/status?window=day"))
    assert above_zero(day["m: requests per minute"], "requests")

    # -- capacity: node-a's memory held by m's replica; big waits ----------------------
    capacity_html = page(cluster, "/status/capacity")
    capacity = charts(capacity_html)
    held = [r for r in capacity["node-a (up): memory"].elements["rect"] if "data-name" in r]
    assert any(r["data-name"].startswith("m ") for r in held), held
    assert int(held[0]["data-value"]) >= GiB
    assert not [r for r in capacity["node-b (up): memory"].elements["rect"]
                if r.get("data-name", "").startswith("m ")]  # fmt: skip
    assert "Waiting, not placed" in capacity_html
    waiting = capacity_html.split("Waiting, not placed")[1]
    assert "<td>big</td><td>unplaceable</td><td>0 of 1</td><td>8 GiB</td>" in waiting

    nowhere = requests.get(url(cluster, "/status/nope"), timeout=10,
                           headers={"Authorization": f"Bearer {token(cluster)}"})  # fmt: skip
    assert nowhere.status_code == 404 and "No view nope here." in nowhere.text

    # -- history: m came up and serves ---------------------------------------------------
    history = charts(page(cluster, "/status/history"))
    assert "serving" in history["m: state"].elements["svg"][0]["data-states"].split(",")
    assert "unplaceable" in history["big: state"].elements["svg"][0]["data-states"]

    # -- usage: the key's team and project ----------------------------------------------
    def usage_shown():
        found = charts(page(cluster, "/status/usage"))
        bars = {r["data-name"]: int(r["data-value"])
                for title in ("tokens per team, last hour", "tokens per project, last hour")
                for r in found[title].elements.get("rect", []) if "data-name" in r}  # fmt: skip
        return bars if bars.get("research") and bars.get("bot") else None

    bars = eventually(usage_shown, timeout=30, what="research and bot in the usage view")
    assert bars["research"] == bars["bot"], "one key, in both"
    labels = 'by="team",name="research",window="hour"'
    assert cluster.metric(f"llmgw_usage_recent_tokens{{{labels}}}") == bars["research"]

    # -- a real browser: the SVG in its DOM, and the charts in its pixels --------------
    dom = browse(cluster, "/status", tmp_path)
    in_dom = charts(dom)
    assert "m: requests per minute" in in_dom, "the browser parsed the inline SVG"
    assert drawn(in_dom["m: requests per minute"], "requests")
    browse(cluster, "/status", tmp_path, shot="status-page.png", height=1500)
    browse(cluster, "/status/capacity", tmp_path, shot="status-capacity.png", height=700)
    shot = (tmp_path / "status-page.png").read_bytes()
    width, height, _ = read_png(shot)
    assert (width, height) == (1280, 1500)
    assert pixels_of(shot, PALETTE[0]) > 64, "the requests line's blue, beside its swatch"
    # The lines are in the browser's picture, not only its DOM: the DOM it built, drawn
    # again from a file with and without the series' lines and dots, differs where the
    # charts are (each hour's plot is about 300 pixels wide).
    lines = re.compile(r"<(polyline|circle)\b[^>]*>(\s*</\1>)?")
    assert len(lines.findall(dom)) >= 6
    (tmp_path / "with.html").write_text(dom)
    (tmp_path / "without.html").write_text(lines.sub("", dom))
    for name in ("with", "without"):
        shoot((tmp_path / f"{name}.html").as_uri(), tmp_path / f"{name}.png", tmp_path, 1500)
    drawn_px = differing(*((tmp_path / f"{n}.png").read_bytes() for n in ("with", "without")))
    assert drawn_px > 600, f"{drawn_px} pixels of lines"
    capacity_png = (tmp_path / "status-capacity.png").read_bytes()
    tone = PALETTE[sorted(["m", "big"]).index("m")]
    assert pixels_of(capacity_png, tone) > 300, "m's replica in node-a's bar"
    keep = os.environ.get("LLMGW_SCREENSHOTS")
    if keep:
        for name in ("status-page.png", "status-capacity.png"):
            shutil.copy(tmp_path / name, os.path.join(keep, name))
