"""The status page at /status: behind the admin token, escaped, and drawn by a real browser."""

import os
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest
import requests

from tests.helpers import eventually
from tests.system.conftest import GiB
from tests.system.test_tls import certmon


def token(cluster) -> str:
    return (cluster.etc / "secrets" / "admin.token").read_text().strip()


def url(cluster, path: str = "/status") -> str:
    return f"http://127.0.0.1:{cluster.admin_port}{path}"


def get(cluster, path: str = "/status", bearer: str | None = None, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    return requests.get(url(cluster, path), headers=headers, allow_redirects=False, timeout=5, **kw)


class Tables(HTMLParser):
    """Each table's rows as lists of cell text, under the <h2> heading before it."""

    def __init__(self, text: str):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.heading = ""
        self._in: str | None = None
        self._row: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "h2":
            self._in, self.heading = "h2", ""
        elif tag == "tr":
            self._row = []
        elif tag == "td" and self._row is not None:
            self._row.append("")
            self._in = "td"

    def handle_endtag(self, tag):
        if tag in ("h2", "td"):
            self._in = None
        elif tag == "tr" and self._row:
            self.tables.setdefault(self.heading, []).append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._in == "h2":
            self.heading += data
        elif self._in == "td":
            self._row[-1] += data


def test_without_the_token_the_page_says_how_to_open_it_and_shows_nothing_else(served):
    for resp in (
        get(served),
        get(served, "/"),
        get(served, bearer="wrong"),
        get(served, "/status?token=wrong"),
        get(served, cookies={"llmgw_admin": "wrong"}),
    ):
        assert resp.status_code == 401, resp.request.url
        assert resp.headers["Content-Type"].startswith("text/html")
        assert "/status?token=" in resp.text and "secrets/admin.token" in resp.text
        assert "node-a" not in resp.text
        assert "Set-Cookie" not in resp.headers


def test_a_token_in_the_url_becomes_a_cookie_and_leaves_the_address_bar(served):
    resp = get(served, f"/status?token={token(served)}")
    assert resp.status_code == 303
    assert resp.headers["Location"] == "/status"
    cookie = [part.strip() for part in resp.headers["Set-Cookie"].split(";")]
    assert cookie[0] == f"llmgw_admin={token(served)}"
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(cookie)
    assert "Secure" not in cookie, "plain HTTP: a Secure cookie would never come back"

    with requests.Session() as browser:
        page = browser.get(url(served, f"/status?token={token(served)}"), timeout=5)
        assert [r.status_code for r in page.history] == [303]
        assert page.status_code == 200 and page.url == url(served, "/status")
        assert browser.get(url(served, "/"), timeout=5).status_code == 200, "the cookie works"


def test_over_https_the_cookie_is_secure_and_still_opens_the_page(cluster):
    etc = cluster.etc
    certmon(etc, "init-ca")
    pki = certmon(etc, "issue", "localhost", "--san", "127.0.0.1")
    cluster.scheduler_extra = (
        f'admin_tls_cert = "{pki / "localhost.crt"}"\nadmin_tls_key = "{pki / "localhost.key"}"\n'
    )
    cluster.start_scheduler()
    base = f"https://127.0.0.1:{cluster.admin_port}"
    ca = str(pki / "ca.crt")  # per request: REQUESTS_CA_BUNDLE would beat Session.verify
    with requests.Session() as browser:
        resp = browser.get(
            f"{base}/status?token={token(cluster)}", verify=ca, allow_redirects=False, timeout=5
        )
        assert resp.status_code == 303
        assert "Secure" in [part.strip() for part in resp.headers["Set-Cookie"].split(";")]
        assert browser.get(f"{base}/status", verify=ca, timeout=5).status_code == 200


def test_the_page_lists_the_nodes_and_the_model_with_its_ready_count(served):
    def ready_page():
        resp = get(served, bearer=token(served))
        rows = Tables(resp.text).tables
        return (resp, rows) if rows["Models"][0][3] == "1" else None

    resp, tables = eventually(ready_page, what="the page to show m ready")
    assert resp.status_code == 200
    assert '<meta http-equiv="refresh" content="10">' in resp.text
    assert resp.headers["Cache-Control"] == "no-store"
    assert resp.headers["X-Frame-Options"] == "DENY"
    csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp
    assert "<script" not in resp.text and "src=" not in resp.text, "nothing external"

    nodes = {row[0]: row for row in tables["Nodes"]}
    assert sorted(nodes) == ["node-a", "node-b"]
    assert [nodes["node-a"][1], nodes["node-b"][1]] == ["up", "up"]
    assert "/ 2 GiB" in nodes["node-a"][2] and "/ 512 MiB" in nodes["node-b"][2]
    ((name, _engine, desired, ready, state, _failures, _reason),) = tables["Models"]
    assert (name, desired, ready, state) == ("m", "1 (1..1)", "1", "serving")
    ((_id, model, profile, node, state, _age, _rss, _reason),) = tables["Replicas"]
    assert (model, profile, node, state) == ("m", "default", "node-a", "ready")
    assert "Needs action" not in tables


def test_an_engine_error_with_html_in_it_is_shown_escaped_under_needs_action(cluster):
    # The agent's error names the weights path, and the path is the operator's text.
    evil = f"{cluster.tmp}/<script>alert(1)</script>.gguf"
    cluster.add_model("doomed", memory=GiB, source=evil)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)

    def parked():
        resp = get(cluster, bearer=token(cluster))
        return resp if "llmgw retry doomed" in resp.text else None

    resp = eventually(parked, timeout=60, what="doomed to be parked on the page")
    assert "<script>" not in resp.text and "</script>" not in resp.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.gguf: no such file" in resp.text
    ((name, *_, state, failures, reason),) = Tables(resp.text).tables["Models"]
    assert (name, state, failures) == ("doomed", "parked", "5")
    assert reason == f"weights {evil}: no such file", "the parser unescapes what the page escaped"


# -- a real browser ---------------------------------------------------------------------


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunk = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unsupported PNG {header}"
    bpp = 4 if colour == 6 else 3
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, [b"".join(r[i : i + 3] for i in range(0, stride, bpp)) for r in rows]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: apt-get install chromium")
        pytest.skip("chromium is missing (apt-get install chromium)")
    return found


def test_chromium_draws_the_page_after_trading_the_url_token_for_the_cookie(served, tmp_path):
    browser = chromium()
    eventually(
        lambda: "serving" in get(served, bearer=token(served)).text, what="m serving on the page"
    )
    shot = tmp_path / "status.png"
    result = subprocess.run(
        [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,900",
            f"--screenshot={shot}", url(served, f"/status?token={token(served)}"),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shot.exists(), f"no screenshot (exit {result.returncode}):\n{result.stderr}"

    width, height, rows = read_png(shot.read_bytes())
    assert (width, height) == (1280, 900)
    pixels = [row[i : i + 3] for row in rows for i in range(0, len(row), 3)]
    white = b"\xff\xff\xff"
    assert sum(p != white for p in pixels) > 0.02 * len(pixels), "a blank page"
    assert len(set(pixels)) > 50, "text and bars are drawn in many shades"
    # The green of an "up"/"serving"/"ready" badge: the page itself, not the 401 page
    # (which has no badges), so the redirect and its cookie worked in a real browser.
    green = bytes.fromhex("1a7f37")
    near = [p for p in pixels if all(abs(x - y) <= 3 for x, y in zip(p, green, strict=True))]
    assert len(near) > 200, f"{len(near)} pixels of the 'up' green"
