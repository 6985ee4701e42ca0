"""`llmgw nodes --gpus`: every GPU of the fleet, with its health and the replica holding it.

`gpu_rows` turns the admin API's NODE shapes into one GPU object per card (the JSON that
`--json` prints); `print_gpus` lays them out for people. A lost node reports no GPUs (what
it last said no longer holds), so it has no rows.
"""

import click

from llmgw_ctl.common import print_table
from llmgw_ctl.status import gib


def health(g: dict) -> str:
    """ok, unhealthy with why, or in MIG mode: the words placement uses."""
    if g.get("healthy") is False:
        return f"unhealthy: {g.get('health') or 'its agent says so'}"
    if str(g.get("mig") or "").lower() == "enabled":
        return "MIG mode (not assigned)"
    return "ok"


def gpu_rows(nodes: list[dict]) -> list[dict]:
    """One object per GPU, by node then index."""
    rows = []
    for n in nodes:
        for g in sorted(n.get("gpus") or [], key=lambda g: g.get("index", -1)):
            total, free = g.get("memory_total"), g.get("memory_free")
            rows.append({
                "node": n["name"], "index": g.get("index"), "uuid": g.get("uuid"),
                "name": g.get("name", ""), "memory_total": total, "memory_free": free,
                "memory_used": total - free if total and free is not None else None,
                "healthy": g.get("healthy", True), "health": g.get("health", ""),
                "mig": g.get("mig", ""), "model": g.get("model"), "replica": g.get("replica"),
            })  # fmt: skip
    return rows


def short_uuid(uuid: str | None) -> str:
    """GPU-6d2f1a9e: enough of a UUID to tell a node's cards apart."""
    return (uuid or "-")[:12]


def print_gpus(rows: list[dict]) -> None:
    if not rows:
        click.echo("no node reports a GPU", err=True)
        return
    print_table(
        ["NODE", "GPU", "UUID", "NAME", "MEMORY GiB (USED/TOTAL)", "HEALTH", "REPLICA"],
        [
            [
                r["node"],
                str(r["index"]),
                short_uuid(r["uuid"]),
                r["name"] or "-",
                f"{gib(r['memory_used'])}/{gib(r['memory_total'])}"
                if r["memory_total"] and r["memory_used"] is not None
                else "-",
                health(r),
                f"{r['model']}/{r['replica']}" if r["replica"] else "-",
            ]
            for r in rows
        ],
    )
