"""`llmgw fabric test`: latency and bandwidth between nodes over their fabric."""

import click

from llmgw_ctl.api import client
from llmgw_ctl.common import pass_state, print_json, print_table

# Per pair: the endpoint's wait, the stream, and slack for a loaded node.
SECONDS_PER_PAIR = 70.0


@click.group("fabric")
def fabric():
    """The network between nodes that hold one replica's shards (agent.fabric_address)."""


def _rate(bps) -> str:
    if bps is None:
        return "-"
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e8 else f"{bps / 1e6:.1f} Mbit/s"


@fabric.command("test")
@click.argument("nodes", nargs=-1, metavar="[NODE…]")
@click.option("--mib", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="MiB streamed one way per pair for the bandwidth figure.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True,
              help="Print {nodes, results: [{from, to, address, latency_ms, …}]}.")  # fmt: skip
@pass_state
def fabric_test(state, nodes, mib, as_json):
    """Measure TCP latency (median round trip of a small message) and bandwidth (one
    stream of --mib MiB) between every pair of NODEs over their fabric addresses; with
    no NODE, between every connected node that reports agent.fabric_address.

    Each pair's second node opens a test endpoint on its fabric address for this test
    only, and the first measures to it; pairs run one at a time. Exits 1 if any pair
    failed (its ERROR says why).

    \b
    Examples:
      llmgw fabric test
      llmgw fabric test gpu-01 gpu-02 --mib 1024
      llmgw fabric test --json | jq '.results[] | {from, to, bits_per_second}'
    """
    api = client(state)
    n = len(nodes) or sum(
        1 for node in api.get("/v1/nodes")
        if ((node.get("topology") or {}).get("fabric") or {}).get("address")
    )  # fmt: skip
    pairs = max(1, n * (n - 1) // 2)
    body = api.post("/v1/fabric/test", {"nodes": list(nodes), "bytes": mib << 20},
                              timeout_s=SECONDS_PER_PAIR * pairs + 10)  # fmt: skip
    failed = any(r.get("error") for r in body["results"])
    if as_json:
        print_json(body)
    else:
        rows = []
        for r in body["results"]:
            latency = "-" if r.get("latency_ms") is None else f"{r['latency_ms']:.3f} ms"
            rows.append([r["from"], r["to"], r.get("address") or "-", latency,
                         _rate(r.get("bits_per_second")), r.get("error") or ""])  # fmt: skip
        print_table(["FROM", "TO", "ADDRESS", "LATENCY", "BANDWIDTH", "ERROR"], rows)
    if failed:
        raise SystemExit(1)
