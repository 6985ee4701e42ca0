"""Failover of the control plane: a leader killed, the standby placing work, the router
serving throughout.

    LLMGW_TEST_POSTGRES=postgresql://postgres@127.0.0.1/postgres \\
        .venv/bin/python bench/failover.py [--runs 5] [--short]

Two real schedulers on a fresh PostgreSQL database, one agent with the fake engine, one
router, with the default lease timings (15 s lease, 5 s renewal, 10 s step-down, 2 s
standby retry) and the default 5 s settle time (--short: the tests' 3 s lease and 1.5 s
settle). A steady stream of requests goes to a model that is running. Each run kills the
leader with SIGKILL and at once asks for an on-demand model, which only a leader can
place; it times the kill to the standby taking the lease, and to the first placement by
the new leader (the on-demand replica appearing in its inventory). The killed scheduler
is started again as the standby for the next run. Writes bench/FAILOVER.md.
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import _drop_pg_database, _fresh_pg_database  # noqa: E402
from tests.helpers import eventually, llmgw  # noqa: E402
from tests.system.conftest import Cluster, GiB, Traffic  # noqa: E402


def role(cluster, name):
    try:
        return cluster.admin("/v1/status", scheduler=name)["control_plane"]["role"]
    except Exception:
        return "down"


def one_run(cluster, leader, standby):
    """Kill `leader`; (seconds to the takeover, seconds to the first placement)."""
    ask = threading.Thread(target=lambda: cluster.chat("lazy", timeout=120), daemon=True)
    t0 = time.monotonic()
    cluster.schedulers[leader].p.send_signal(signal.SIGKILL)
    ask.start()
    took = placed = None
    while placed is None:
        now = time.monotonic() - t0
        assert now < 120, "no placement within 120 s"
        if took is None and role(cluster, standby) == "leader":
            took = now
        if took is not None:
            reps = cluster.admin("/v1/replicas?model=lazy", scheduler=standby)
            if reps:
                placed = time.monotonic() - t0
        time.sleep(0.02)
    ask.join()
    return took, placed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--short", action="store_true", help="the tests' short timings")
    args = ap.parse_args()
    admin = os.environ.get("LLMGW_TEST_POSTGRES")
    if not admin:
        sys.exit("set LLMGW_TEST_POSTGRES to a PostgreSQL URL that may create databases")
    url = _fresh_pg_database(admin)
    results, failed, served = [], [], 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ.update(LLMGW_STORE=url, LLMGW_CONFIG=str(tmp / "none.toml"))
        (tmp / "none.toml").write_text("")
        key = llmgw("keys", "create", "--store", "--name", "bench", "--json").stdout
        cluster = Cluster(tmp)
        if not args.short:
            cluster.lease = ""  # the defaults
            cluster.settle_s = 5.0
        cluster.add_scheduler("s2")
        cluster.add_model("m", memory=GiB)
        cluster.add_model("lazy", memory=GiB, min_=0, keep_alive=3.0)
        try:
            cluster.start_scheduler("s1")
            eventually(lambda: role(cluster, "s1") == "leader", timeout=30)
            cluster.start_scheduler("s2")
            cluster.start_agent("node-a", memory=4 * GiB)
            import json

            cluster.start_router(json.loads(key)["secret"])
            eventually(lambda: cluster.serves("m"), timeout=60, what="m to be served")
            leader, standby = "s1", "s2"
            for i in range(args.runs):
                eventually(
                    lambda s=leader: not cluster.admin("/v1/replicas?model=lazy", scheduler=s),
                    timeout=60,
                    what="the on-demand model to be idle again",
                )
                traffic = Traffic(cluster)
                eventually(lambda t=traffic: t.ok > 10, what="traffic")
                took, placed = one_run(cluster, leader, standby)
                traffic.stop()
                results.append((took, placed))
                failed += traffic.failed
                served += traffic.ok
                print(f"run {i + 1}: lease taken {took:.2f} s, first placement {placed:.2f} s,"
                      f" {traffic.ok} requests served, {len(traffic.failed)} failed")  # fmt: skip
                cluster.schedulers[leader].stop()
                cluster.start_scheduler(leader)  # back as the standby
                leader, standby = standby, leader
        finally:
            cluster.stop()
            _drop_pg_database(admin, url)
    write(results, failed, served, args)


def write(results, failed, served, args) -> None:
    took = [t for t, _ in results]
    placed = [p for _, p in results]
    timings = (
        "tests' (3 s lease, 0.5 s renewal, 2 s step-down, 0.3 s retry, 1.5 s settle)"
        if (args.short)
        else "default (15 s lease, 5 s renewal, 10 s step-down, 2 s retry, 5 s settle)"
    )
    lines = [
        "# Control-plane failover",
        "",
        f"Measured {datetime.now(UTC):%Y-%m-%d} by `bench/failover.py --runs {args.runs}"
        f"{' --short' if args.short else ''}` on this 2-core machine, PostgreSQL 15 local;"
        f" {timings} timings. The leader is killed with SIGKILL under a steady stream of"
        " requests; the clock runs from the kill.",
        "",
        "| run | standby takes the lease (s) | first placement by the new leader (s) |",
        "|--:|--:|--:|",
        *[f"| {i + 1} | {t:.2f} | {p:.2f} |" for i, (t, p) in enumerate(results)],
        f"| median | {statistics.median(took):.2f} | {statistics.median(placed):.2f} |",
        f"| max | {max(took):.2f} | {max(placed):.2f} |",
        "",
        f"Requests through the router during the runs: {served} answered, {len(failed)} failed"
        + (f" ({', '.join(sorted(set(failed)))})." if failed else "."),
        "",
        "The lease is taken once the killed leader's lease runs out (at most `lease_s` after"
        " its last renewal, which came up to `renew_s` before the kill) plus up to one"
        " standby retry; the first placement follows after `settle_s`, the wait for fresh"
        " heartbeats before placing anything.",
        "",
    ]
    out = ROOT / "bench" / ("FAILOVER-short.md" if args.short else "FAILOVER.md")
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
