"""The running control plane at fleet scale: the real llmgw-scheduler with N simulated
agents and M simulated routers on real sockets (tests/sim_fleet.py, tests/sim_plane.py).

    LLMGW_TEST_POSTGRES=postgresql://postgres@127.0.0.1/postgres \\
        nice .venv/bin/python bench/fleet_scale.py [--steps 100,300,1000] [--routers 20]

Each step starts a fresh store (PostgreSQL when LLMGW_TEST_POSTGRES is set; the last
step again on SQLite) and scheduler, registers N agent and M router keys, and starts
the peers: every agent says hello, heartbeats every 2 s (the default), and answers each
start with a port that answers HTTP; every router is the router's own Feed, reporting
activity every 2 s. The catalog has N models of two replicas each (2N replicas; one
model in eight wants a GPU, every fourth node has eight). With the scheduler's default
timings it measures: the time from the last hello to every replica started (first full
placement) and to every router holding them all; then over a steady window the
scheduler's CPU (utime + stime from /proc/PID/stat) and RSS, and the store's writes
(PostgreSQL: rows inserted, updated and deleted per second from pg_stat_database; SQLite:
bytes the scheduler wrote, /proc/PID/io); heartbeat lag (for each node, its last_seen in
/v1/nodes less when its agent sent that heartbeat); the latency of /v1/status, the
status page and `llmgw status`; and five catalog changes (`models add`), each timed until
every router holds the table that has it (p50, p99 over all routers and changes).

Writes bench/FLEET_SCALE.md (the text after its "<!-- analysis -->" line is kept) and
bench/FLEET_SCALE.png.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.sim_fleet import cpu_seconds, pids, rss_bytes  # noqa: E402
from tests.sim_plane import Plane  # noqa: E402

OUT = ROOT / "bench" / "FLEET_SCALE.md"
PNG = ROOT / "bench" / "FLEET_SCALE.png"
MARK = "<!-- analysis -->"
CHANGES = 5
BARS = {"cpu": 50.0, "change_p99": 1.0, "status_cli": 1.0, "router_apply_ms": 100.0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def wait(cond, timeout: float, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    return None


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


class PgStats:
    """Rows written to one PostgreSQL database, from pg_stat_database."""

    def __init__(self, url: str):
        import psycopg2

        self.conn = psycopg2.connect(url)
        self.conn.autocommit = True
        self.name = url.rsplit("/", 1)[1]

    def rows(self) -> int:
        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_stat_clear_snapshot()")
            cur.execute("SELECT tup_inserted + tup_updated + tup_deleted FROM pg_stat_database"
                        " WHERE datname = %s", (self.name,))  # fmt: skip
            return int(cur.fetchone()[0])


def write_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


def step(n: int, routers: int, store: str, window: float, processes: int) -> dict:
    from tests.conftest import _drop_pg_database, _fresh_pg_database

    pg_admin = os.environ.get("LLMGW_TEST_POSTGRES", "")
    with tempfile.TemporaryDirectory() as tmp:
        url = _fresh_pg_database(pg_admin) if store == "postgresql" else ""
        plane = Plane(Path(tmp), agents=n, routers=routers, store_url=url,
                      agent_processes=processes)  # fmt: skip
        row = {"n": n, "m": routers, "store": store, "replicas": plane.replicas_wanted}
        try:
            started = time.monotonic()
            plane.start()
            row["register_s"] = time.monotonic() - started
            # Agents join a scheduler that has run a while: past its settle time (5 s),
            # which would otherwise hold the first placement back.
            time.sleep(6)
            plane.start_peers()
            sim = plane.sim

            def all_hello():
                agents = sim.ask("agents")
                ok = len(agents) == n and all(a["hello_at"] for a in agents.values())
                return agents if ok else None

            agents = wait(all_hello, 120 + n / 10)
            if agents is None:
                raise RuntimeError("not every agent could say hello")
            last_hello = max(a["hello_at"] for a in agents.values())
            placed = wait(lambda: sum(a["starts"] for a in sim.ask("agents").values())
                          >= plane.replicas_wanted and time.time(), 300)  # fmt: skip
            served = wait(lambda: all(r["endpoints"] >= plane.replicas_wanted
                                      for r in sim.ask("routers").values()) and time.time(),
                          300)  # fmt: skip
            row["placed_s"] = placed - last_hello if placed else None
            row["served_s"] = served - last_hello if served else None
            time.sleep(5)  # the starts' last reports, then steady
            pid = plane.proc.p.pid
            pg = PgStats(url) if url else None
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            sims0 = sum(cpu_seconds(p) for p in pids(sim))
            rows0 = pg.rows() if pg else 0
            io0 = write_bytes(pid)
            time.sleep(window)
            elapsed = time.monotonic() - t0
            row["cpu_pct"] = 100 * (cpu_seconds(pid) - cpu0) / elapsed
            row["sim_cpu_pct"] = 100 * (sum(cpu_seconds(p) for p in pids(sim)) - sims0) / elapsed
            row["rows_s"] = (pg.rows() - rows0) / elapsed if pg else None
            row["write_kib_s"] = (write_bytes(pid) - io0) / elapsed / 1024
            row["rss_mib"] = rss_bytes(pid) / 2**20
            # Heartbeat lag: when the scheduler took each node's last heartbeat, less
            # when the agent sent it.
            nodes = plane.get("/v1/nodes").json()
            sends = {name: a["sends"] for name, a in sim.ask("agents").items()}
            lags = []
            for node in nodes:
                seen, sent = node.get("last_seen"), sends.get(node["name"]) or []
                before = [s for s in sent if seen and s <= seen]
                if before:
                    lags.append(seen - before[-1])
            row["up"] = sum(1 for x in nodes if x["state"] == "up")
            row["lag_p50_ms"], row["lag_p99_ms"] = 1000 * pct(lags, 0.5), 1000 * pct(lags, 0.99)
            api = timed(lambda: plane.get("/v1/status"), 5)
            page = timed(lambda: plane.get("/status"), 5)
            cli = timed(lambda: plane.ctl("status"), 3)
            row["api_ms"], row["page_ms"] = (
                1000 * statistics.median(api),
                1000 * statistics.median(page),
            )
            row["cli_s"] = statistics.median(cli)
            delays = []
            for i in range(CHANGES):
                asked = plane.add_model(f"change-{i}")

                def everywhere(i=i):
                    got = sim.ask(f"seen change-{i}")
                    return got if got and all(got.values()) else None

                seen = wait(everywhere, 30, 0.05)
                if seen is None:
                    raise RuntimeError(f"a router never got the table with change-{i}")
                delays += [t - asked for t in seen.values()]
                time.sleep(1)
            row["change_p50_s"], row["change_p99_s"] = pct(delays, 0.5), pct(delays, 0.99)
            row["load"] = os.getloadavg()[0]
        finally:
            plane.stop()
            if url:
                _drop_pg_database(pg_admin, url)
    return row


def router_apply_ms() -> tuple[float, float]:
    """(a change, a whole table) applied by a router holding 50,000 replicas, in ms
    (bench/scheduler.py's measures)."""
    import scheduler

    return scheduler.bench_diff(50_000), scheduler.bench_routes(50_000)


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ["N agents", "store", "replicas", "sched CPU % of a core", "sched RSS MiB",
            "hello → placed s", "hello → routers hold all s", "change → 20 routers p50 / p99 s",
            "heartbeat lag p50 / p99 ms", "/v1/status ms", "status page ms", "`llmgw status` s",
            "store writes", "sims CPU %", "load"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        writes = (f"{r['rows_s']:.1f} rows/s" if r.get("rows_s") is not None
                  else f"{r['write_kib_s']:.0f} KiB/s")  # fmt: skip
        out.append("| " + " | ".join([
            f"{r['n']:,}", r["store"], f"{r['replicas']:,}", fmt(r.get("cpu_pct"), ".1f"),
            fmt(r.get("rss_mib"), ".0f"), fmt(r.get("placed_s"), ".1f"),
            fmt(r.get("served_s"), ".1f"),
            f"{fmt(r.get('change_p50_s'), '.2f')} / {fmt(r.get('change_p99_s'), '.2f')}",
            f"{fmt(r.get('lag_p50_ms'), '.0f')} / {fmt(r.get('lag_p99_ms'), '.0f')}",
            fmt(r.get("api_ms"), ".0f"), fmt(r.get("page_ms"), ".0f"), fmt(r.get("cli_s"), ".2f"),
            writes, fmt(r.get("sim_cpu_pct"), ".0f"), fmt(r.get("load"), ".1f"),
        ]) + " |")  # fmt: skip
    return "\n".join(out)


def bars(rows: list[dict], apply_ms: tuple[float, float]) -> list[str]:
    at = [r for r in rows if r["n"] == 1000 and "cpu_pct" in r]
    r = at[0] if at else None

    def verdict(ok: bool) -> str:
        return "holds" if ok else "MISSED"

    out = []
    if r is None:
        out.append("- no step of 1,000 agents finished: the fleet bars are not judged")
    else:
        out += [
            f"- 1,000 agents at the default heartbeat, scheduler CPU {r['cpu_pct']:.1f}% of one "
            f"core (bar < {BARS['cpu']:g}%): {verdict(r['cpu_pct'] < BARS['cpu'])}",
            f"- a table change reaching {r['m']} routers, p99 {r['change_p99_s']:.2f} s "
            f"(bar ≤ {BARS['change_p99']:g} s): {verdict(r['change_p99_s'] <= BARS['change_p99'])}",
            f"- `llmgw status` on 1,000 nodes, {r['cli_s']:.2f} s (bar ≤ {BARS['status_cli']:g} s):"
            f" {verdict(r['cli_s'] <= BARS['status_cli'])}",
        ]  # fmt: skip
    diff, whole = apply_ms
    out.append(
        f"- a router applying a change to a 50,000-replica table, {diff:.0f} ms (bar ≤ "
        f"{BARS['router_apply_ms']:g} ms): {verdict(diff <= BARS['router_apply_ms'])}; the whole "
        f"table, which a router takes only when it starts or missed a diff, {whole:.0f} ms"
    )
    return out


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "cpu_pct" in r]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    panels = [
        ("scheduler CPU, % of a core", "cpu_pct", BARS["cpu"]),
        ("table change to every router, p99 s", "change_p99_s", BARS["change_p99"]),
        ("`llmgw status`, s", "cli_s", BARS["status_cli"]),
        ("heartbeat lag p99, ms", "lag_p99_ms", None),
    ]
    for ax, (title, key, bar) in zip(axes, panels, strict=True):
        for store, style in (("postgresql", "o-"), ("sqlite", "s--")):
            pts = [(r["n"], r[key]) for r in rows if r["store"] == store and r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=store)
        if bar is not None:
            ax.axhline(bar, color="red", linestyle=":", label="bar")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("agents")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PNG, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="100,300,1000", help="agent counts, comma-separated")
    parser.add_argument("--routers", type=int, default=20)
    parser.add_argument("--window", type=float, default=20.0, help="steady seconds measured")
    parser.add_argument("--processes", type=int, default=4, help="processes playing agents")
    parser.add_argument("--sqlite", default="1000", help="steps run again on SQLite")
    args = parser.parse_args()
    store = "postgresql" if os.environ.get("LLMGW_TEST_POSTGRES") else "sqlite"
    plan = [(int(s), store) for s in args.steps.split(",") if s]
    if store == "postgresql":
        plan += [(int(s), "sqlite") for s in args.sqlite.split(",") if s]
    load_before = os.getloadavg()[0]
    rows = []
    for n, kind in plan:
        print(f"step: {n} agents, {args.routers} routers, {kind}", flush=True)
        try:
            row = step(n, args.routers, kind, args.window, args.processes)
        except Exception as e:  # the first thing that breaks is a result too
            row = {"n": n, "m": args.routers, "store": kind, "replicas": 2 * n,
                   "broke": f"{type(e).__name__}: {e}"}  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    apply_ms = router_apply_ms()
    kept = OUT.read_text().split(MARK, 1)[1] if OUT.exists() and MARK in OUT.read_text() else "\n"
    broke = [f"- {r['n']:,} agents ({r['store']}): {r['broke']}" for r in rows if "broke" in r]
    text = (
        "# The control plane at fleet scale\n\n"
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs shared with other "
        f"work (load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
        "end; each row says the load at its end). Made by `nice .venv/bin/python "
        "bench/fleet_scale.py`: the real scheduler, with its default timings, and simulated "
        "agents and routers on real CURVE sockets in a few processes on the same machine "
        f"(their CPU is the sims column). {CHANGES} catalog changes per step; a "
        f"{args.window:g} s steady window.\n\n"
        + table([r for r in rows if "broke" not in r]) + "\n\n"
        + ("What broke:\n\n" + "\n".join(broke) + "\n\n" if broke else "")
        + "Bars:\n\n" + "\n".join(bars(rows, apply_ms)) + "\n\n"
        + "![the curves](FLEET_SCALE.png)\n\n" + MARK + kept
    )  # fmt: skip
    OUT.write_text(text)
    plot(rows)
    print(text)


if __name__ == "__main__":
    main()
