"""Shards of a replica across nodes: llama.cpp's `rpc-server` on each node of the gang
(its command and the leader's arguments are the engine's: llmgw/engines/llamacpp.py),
or vLLM's ranks (`Rank`: the leader is rank 0, its workers headless ranks that load their
own part of the weights and join it at ADDR:PORT; llmgw/engines/vllm.py).

A replica too big for one node runs as a gang (docs/multinode.md): every node of it runs
an `rpc-server` holding part of the weights, and the leader's `llama-server` drives them
with `--rpc HOST:PORT,…`. rpc-server has no authentication at all — llama.cpp warns
never to expose it — so a worker listens only on the node's fabric address, never on
0.0.0.0 or a public address, and the firewall rule in docs/multinode.md admits only the
gang's nodes to its port.

An rpc-server worker needs no weights of its own: the leader sends it its tensors.
vLLM's ranks meet at the leader's fabric address with no authentication either (torch's
TCPStore, gloo), so they too take only agent.fabric_address.
"""

import ipaddress
import socket
from dataclasses import dataclass

from llmgw.config import AgentConfig
from llmgw_agentd.errors import AgentError

ROLE = "rpc-worker"
PROBE_TIMEOUT_S = 1.0


def fabric_host(cfg: AgentConfig) -> str:
    """The address a worker may listen on: agent.fabric_address, if it is a private one."""
    address = cfg.fabric_address.strip()
    if not address:
        raise AgentError(
            "a shard of a replica across nodes needs agent.fabric_address: the address of"
            " this node on the network between the nodes of one replica"
        )
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise AgentError(f"agent.fabric_address {address!r} is not an IP address") from None
    if ip.is_unspecified:
        raise AgentError(
            f"agent.fabric_address is {address}: the workers of a replica across nodes have"
            " no authentication and must not listen on every interface; give this node's"
            " fabric address"
        )
    if not (ip.is_private or ip.is_loopback or ip.is_link_local):
        raise AgentError(
            f"agent.fabric_address {address} is a public address: the workers of a replica"
            " across nodes have no authentication; use a private fabric network"
            " (docs/multinode.md)"
        )
    return address


@dataclass(frozen=True)
class Rank:
    """A shard's place in a gang whose workers join the leader (start_shard's `gang`)."""

    nnodes: int
    rank: int  # 0: the leader
    master: str = ""  # ADDR:PORT the ranks meet at; the leader's agent chooses it


def rank_of(req: dict) -> Rank | None:
    """The `gang` of a start_shard; None where it has none."""
    gang = req.get("gang")
    if not gang:
        return None
    try:
        rank = Rank(int(gang["nnodes"]), int(gang.get("rank") or 0), str(gang.get("master") or ""))
    except (KeyError, TypeError, ValueError):
        raise AgentError(f"start_shard's gang {gang!r} is not nnodes, rank, master") from None
    if rank.nnodes < 2 or not 0 <= rank.rank < rank.nnodes:
        raise AgentError(f"start_shard's gang {gang!r}: want nnodes >= 2, 0 <= rank < nnodes")
    if rank.rank and not rank.master:
        raise AgentError(f"start_shard's gang {gang!r}: a worker needs its leader's ADDR:PORT")
    return rank


def listening(endpoint: str) -> bool:
    """Whether a worker at HOST:PORT accepts connections (it has no HTTP to ask)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False
