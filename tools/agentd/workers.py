"""Shards of a replica across nodes: llama.cpp's `rpc-server` on each node of the gang
(its command and the leader's arguments are the engine's: llmgw/engines/llamacpp.py).

A replica too big for one node runs as a gang (docs/multinode.md): every node of it runs
an `rpc-server` holding part of the weights, and the leader's `llama-server` drives them
with `--rpc HOST:PORT,…`. rpc-server has no authentication at all — llama.cpp warns
never to expose it — so a worker listens only on the node's fabric address, never on
0.0.0.0 or a public address, and the firewall rule in docs/multinode.md admits only the
gang's nodes to its port.

A worker needs no weights of its own: the leader sends it its tensors.
"""

import ipaddress
import socket

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
            f"agent.fabric_address is {address}: rpc-server has no authentication and must"
            " not listen on every interface; give this node's fabric address"
        )
    if not (ip.is_private or ip.is_loopback or ip.is_link_local):
        raise AgentError(
            f"agent.fabric_address {address} is a public address: rpc-server has no"
            " authentication; use a private fabric network (docs/multinode.md)"
        )
    return address


def listening(endpoint: str) -> bool:
    """Whether a worker at HOST:PORT accepts connections (it has no HTTP to ask)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False
