"""The read-only status page (HTML), served by the admin API at / and /status.

For people with a browser, behind the admin API's token. A browser cannot send a bearer
header from the address bar, so the page also takes the token once as `?token=`, keeps
it in an HttpOnly cookie and redirects to the same path without it: the token stays out
of the address bar, the history and the Referer. With sign-on configured ([oidc]), a
browser with no credential is sent to sign in with the identity provider instead, and
comes back with a session cookie (signon.py). `render` is pure (view data and the time
in, HTML out); `serve` is the HTTP edge.
"""

import ssl
import time
from html import escape
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode

from llmgw import oidc
from llmgw.human import age
from llmgw.operators import Who
from llmgw.placement import size
from llmgw_scheduler import signon
from llmgw_scheduler.fleet_api import View

COOKIE = "llmgw_admin"
REFRESH_S = 10

# No script, no frames, no external anything: the only things allowed are the inline CSS
# and the sign-out form, which posts to this scheduler.
# no-store: the page is a snapshot of the fleet behind a token; no cache should keep it.
HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
}

# Model states an operator must act on, first on the page, with what to run.
NEEDS_ACTION = {
    "parked": "fix the cause, then <code>llmgw retry {name}</code>",
    "unplaceable": "<code>llmgw explain-placement {name}</code> says why each node refuses it",
}

# Colour classes for states, so the eye finds what is wrong before reading.
TONE = {
    "up": "ok", "serving": "ok", "ready": "ok", "ok": "ok", "MIG mode": "idle",
    "unhealthy": "bad",
    "starting": "busy", "pending": "busy", "stopped": "idle", "never seen": "idle",
    "draining": "warn", "stopping": "warn", "backoff": "warn",
    "lost": "bad", "parked": "bad", "unplaceable": "bad", "failed": "bad",
}  # fmt: skip

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1f2328;background:#fff}
h1{font-size:1.5em;margin:0}h2{font-size:1.15em;margin:1.5em 0 .5em}
.muted{color:#656d76}.summary span{margin-right:1.5em}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.35em .6em;border-bottom:1px solid #d0d7de;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
.state{display:inline-block;padding:0 .5em;border-radius:.8em;color:#fff;font-size:.9em}
.ok{background:#1a7f37}.busy{background:#0969da}.warn{background:#bf8700}
.bad{background:#cf222e}.idle{background:#6e7781}
.bar{display:inline-block;vertical-align:middle;width:10em;height:.8em;margin-right:.5em;
background:#d0d7de;border-radius:.4em;overflow:hidden}
.bar div{height:100%;background:#0969da}.bar div.high{background:#cf222e}
.gpu{margin-bottom:.3em;white-space:nowrap}
.action{border-left:4px solid #cf222e;background:#fff8f8;padding:.5em 1em;margin:.5em 0}
pre{white-space:pre-wrap;word-break:break-word;max-height:12em;overflow:auto;margin:.3em 0;
background:#f6f8fa;padding:.5em}
code{background:#eff1f3;padding:0 .25em}
form.signout{display:inline}form.signout button{font:inherit;padding:0 .4em}
"""


def e(value) -> str:
    """Everything shown is escaped: model names, reasons and engine output come from
    operators and engines, and the page sits behind the admin token."""
    return escape(str(value), quote=True)


def state(name: str) -> str:
    return f'<span class="state {TONE.get(name, "idle")}">{e(name)}</span>'


def bar(used: int, total: int) -> str:
    """A usage bar with "used / total" beside it; "-" when the total is unknown."""
    if not total:
        return "-"
    used = min(max(used, 0), total)
    pct = 100 * used / total
    high = ' class="high"' if pct >= 90 else ""
    return (
        f'<div class="bar" title="{pct:.0f}% used"><div{high} style="width:{pct:.1f}%">'
        f"</div></div>{e(size(used))} / {e(size(total))}"
    )


def gpu_bars(gpus: list[dict]) -> str:
    if not gpus:
        return "-"
    out = []
    for g in gpus:
        label = e(f"{g.get('index', '?')} {g.get('name', '')}".strip())
        total = g.get("memory_total")
        used = total - (g.get("memory_free") or 0) if total else 0
        out.append(f'<div class="gpu">{label} {bar(used, total or 0)}</div>')
    return "".join(out)


def gpu_health(g: dict) -> str:
    if g.get("healthy") is False:
        return state("unhealthy") + f" {e(g.get('health') or '')}"
    if str(g.get("mig") or "").lower() == "enabled":
        return state("MIG mode") + ' <span class="muted">not assigned</span>'
    return state("ok")


def gpu_map(nodes: list[dict]) -> list[list[str]]:
    """Node → GPU → the replica assigned it: one row per GPU of every node not lost."""
    rows = []
    for n in nodes:
        for g in sorted(n.get("gpus") or [], key=lambda g: g.get("index", -1)):
            total = g.get("memory_total")
            used = total - (g.get("memory_free") or 0) if total else 0
            held = (
                f'{e(g["model"])} <span class="muted">{e(g["replica"])}</span>'
                if g.get("replica")
                else '<span class="muted">none</span>'
            )
            rows.append([
                e(n["name"]), e(g.get("index", "?")),
                f'<span title="{e(g.get("uuid", ""))}">{e((g.get("uuid") or "-")[:12])}</span>',
                e(g.get("name", "")), bar(used, total or 0), gpu_health(g), held,
            ])  # fmt: skip
    return rows


def last_line(text: str, limit: int = 160) -> str:
    """An engine's reason is its output's tail; the last line is what went wrong."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def table(head: list[str], rows: list[list[str]], empty: str) -> str:
    """Cells are HTML already (escaped by whoever built them)."""
    if not rows:
        return f'<p class="muted">{e(empty)}</p>'
    th = "".join(f"<th>{e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def signed_in(who: Who | None) -> str:
    """Who is signed on through the identity provider, and the way out; nothing for a
    token, which the browser holds until its cookie is cleared."""
    if who is None or who.via != oidc.VIA:
        return ""
    return (
        # A div, not a p: a form inside a paragraph ends it, and the button drops a line.
        f'<div class="muted">signed in as {e(who.name)} ({e(who.role)}) '
        '<form class="signout" method="post" action="/logout">'
        "<button>sign out</button></form></div>"
    )


def render(nodes: list[dict], models: list[dict], replicas: list[dict], now: float,
           who: Who | None = None) -> str:  # fmt: skip
    """The page, from the admin API's NODE, MODEL and REPLICA shapes; `who`: the
    operator looking at it."""
    up = sum(1 for n in nodes if n["state"] == "up")
    serving = sum(1 for m in models if m["state"] == "serving")
    ready = sum(1 for r in replicas if r["state"] == "ready")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))

    actions = [
        f'<div class="action"><strong>{e(m["name"])}</strong> {state(m["state"])} '
        f"{NEEDS_ACTION[m['state']].format(name=e(m['name']))}"
        f"<pre>{e(m.get('reason') or 'no reason recorded')}</pre></div>"
        for m in models
        if m["state"] in NEEDS_ACTION
    ]
    node_rows = [
        [
            e(n["name"]),
            state(n["state"]),
            "unknown (lost)"
            if n.get("memory_available") is None
            else bar(n["memory_total"] - n["memory_available"], n["memory_total"]),
            gpu_bars(n.get("gpus") or []),
            e(n.get("cpus") or "-"),
            e(n.get("replicas", 0)),
            e(age(n.get("last_seen"), now)) + (" ago" if n.get("last_seen") else ""),
        ]
        for n in nodes
    ]
    model_rows = [
        [
            e(m["name"])
            + "".join(f'<br><span class="muted">{e(a)}</span>' for a in m.get("aliases", [])),
            e(m.get("engine", "")),
            e(f"{m.get('desired', m['min'])} ({m['min']}..{m['max']})"),
            e(m["ready"])
            + (f' <span class="muted">+{e(m["lost"])} lost</span>' if m.get("lost") else ""),
            state(m["state"]),
            e(m.get("failures", 0)),
            e(last_line(m.get("reason", ""))),
        ]
        for m in sorted(models, key=lambda m: (m["state"] not in NEEDS_ACTION, m["name"]))
    ]
    replica_rows = [
        [
            e(r["id"]),
            e(r["model"]),
            e(r.get("profile") or "-"),
            e(r["node"]),
            state(r["state"]),
            e(age(r.get("created") or r.get("since"), now)),
            e(size(r["rss"])) if r.get("rss") else "-",
            e(last_line(r.get("reason", ""))),
        ]
        for r in replicas
    ]
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_S}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>llmgw status</title><style>{CSS}</style></head><body>"
        f'<h1>llmgw</h1><p class="muted">as of {e(when)}, refreshed every {REFRESH_S} s</p>'
        + signed_in(who)
        + f'<p class="summary"><span>nodes up {up}/{len(nodes)}</span>'
        f"<span>models serving {serving}/{len(models)}</span>"
        f"<span>replicas ready {ready}/{len(replicas)}</span></p>"
        + (f"<h2>Needs action</h2>{''.join(actions)}" if actions else "")
        + "<h2>Nodes</h2>"
        + table(
            ["node", "state", "memory used", "GPU memory used", "CPUs", "replicas", "last seen"],
            node_rows,
            "No nodes are registered: llmgw nodes add NAME",
        )
        + (
            "<h2>GPUs</h2>"
            + table(["node", "GPU", "UUID", "name", "memory used", "health", "replica"], gpus, "")
            if (gpus := gpu_map(nodes))
            else ""
        )
        + "<h2>Models</h2>"
        + table(
            ["model", "engine", "desired", "ready", "state", "failed starts", "reason"],
            model_rows,
            "No models in the catalog.",
        )
        + "<h2>Replicas</h2>"
        + table(
            ["replica", "model", "profile", "node", "state", "age", "memory", "reason"],
            replica_rows,
            "No replicas.",
        )
        + "</body></html>\n"
    )


UNAUTHORISED = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmgw status: token needed</title>
<style>{CSS}</style></head><body>
<h1>llmgw</h1>
<p>This page needs the scheduler's admin token. Open it once as
<code>/status?token=TOKEN</code>: the browser keeps the token in a cookie and the address
bar drops it.</p>
<p>The token is an operator's (<code>llmgw operators add NAME</code>), or the bootstrap
token: <code>scheduler.admin_token</code> in the scheduler's config or, when that is
not set, the file <code>&lt;config_dir&gt;/secrets/admin.token</code>
(<code>/etc/llmgw/secrets/admin.token</code> by default) on the scheduler's machine.</p>
</body></html>
"""


SIGN_IN = """<p>Or <a href="/login">sign in</a> with the identity provider.</p>
"""


def unauthorised(with_signon: bool) -> str:
    return UNAUTHORISED.replace("</body>", SIGN_IN + "</body>") if with_signon else UNAUTHORISED


def send(handler, status: int, body: str = "", headers: dict | None = None) -> None:
    """An HTML answer with the page's headers; a Set-Cookie value may be a list."""
    data = body.encode()
    handler.send_response(status)
    for name, value in {**HEADERS, **(headers or {})}.items():
        for one in value if isinstance(value, list) else [value]:
            handler.send_header(name, one)
    if data:
        handler.send_header("Content-Type", "text/html; charset=utf-8")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _identify(handler, token: str | None) -> Who | None:
    """The operator a token names; None for one that names nobody, the reason logged."""
    try:
        return handler.identify(token)
    except oidc.SignOnError:
        return None


def authenticate(handler):
    """The operator behind the request, from a bearer token, the cookie, `?token=` or a
    sign-on session (any role: the page only shows); None once the 401 page or a
    redirect is answered: one that drops `?token=` from the address bar, or, with
    sign-on, one to sign in for a browser that brings no credential at all."""
    url = handler.url
    query = parse_qsl(url.query, keep_blank_values=True)
    given = [v for k, v in query if k == "token"]
    with_signon = handler.signon is not None
    if given:
        if _identify(handler, given[-1]) is None:
            return send(handler, 401, unauthorised(with_signon))
        jar = SimpleCookie()
        jar[COOKIE] = given[-1]
        jar[COOKIE].update({"httponly": True, "samesite": "Strict", "path": "/"})
        if isinstance(handler.connection, ssl.SSLSocket):
            jar[COOKIE]["secure"] = True
        rest = urlencode([(k, v) for k, v in query if k != "token"])
        location = url.path + (f"?{rest}" if rest else "")
        return send(
            handler,
            303,
            headers={"Location": location, "Set-Cookie": jar[COOKIE].OutputString()},
        )
    bearer = handler.headers.get("Authorization", "")
    token = signon.cookie(handler, COOKIE)
    who = (
        (bearer.startswith("Bearer ") and _identify(handler, bearer[7:].strip()))
        or _identify(handler, token)
        or (handler.signon.session(signon.cookie(handler, signon.SESSION_COOKIE))
            if with_signon else None)
    )  # fmt: skip
    if not who:
        if with_signon and not bearer and not token:
            where = urlencode({"next": url.path})
            return send(handler, 303, headers={"Location": f"/login?{where}"})
        return send(handler, 401, unauthorised(with_signon))
    return who


def serve(handler) -> None:
    """GET / or /status, once `authenticate` has let the request through."""
    sched = handler.sched
    with sched.lock:
        view = View(sched)
        nodes, models, replicas = view.nodes(), view.models(), view.replicas()
        now = sched.clock()
    send(handler, 200, render(nodes, models, replicas, now, handler.who))
