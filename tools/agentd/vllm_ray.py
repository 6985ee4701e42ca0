"""One vLLM replica across several nodes, on Ray as vLLM documents it, as data.

The leader's node runs `ray start --head`, every other node `ray start --address
LEADER:PORT`, and once the cluster has every GPU the leader runs vLLM's OpenAI server
with `--tensor-parallel-size T --pipeline-parallel-size P --distributed-executor-backend
ray`. This module only builds those command lines and environments (a plan); starting,
waiting and supervising them is the agent's (the shard runtime), so the plan can be
checked as data in milliseconds.

Every socket these processes open is pinned to the fabric: Ray's node address is the
node's `agent.fabric_address`, NCCL and Gloo use `agent.fabric_interface`
(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), vLLM's own address is VLLM_HOST_IP. Every port
comes from a block the caller took from that node's port range (`agent.port_min` ..
`port_max`), never Ray's defaults: Ray would otherwise pick its GCS, raylet, object
manager and worker ports at random, outside any firewall rule written for the range.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

from llmgw.engines import Launch
from llmgw.engines.vllm import server_command as vllm_command
from llmgw_agentd.errors import EngineError

# Offsets in a node's port block. The head's GCS port is the one workers dial.
GCS, NODE_MANAGER, OBJECT_MANAGER, CLIENT_SERVER = 0, 1, 2, 3
AGENT_LISTEN, AGENT_GRPC, METRICS_EXPORT, RUNTIME_ENV = 4, 5, 6, 7
DIST_INIT = 8  # the leader's: vLLM's torch.distributed init (VLLM_PORT)
WORKERS_FROM = 9  # Ray worker processes: the rest of the block
# Ray starts a few idle workers beside one per GPU; fewer ports than this and it stalls.
SPARE_WORKER_PORTS = 8

HEAD, WORKER, SERVE = "ray-head", "ray-worker", "serve"


@dataclass(frozen=True)
class Member:
    """One node of the replica, as the plan needs it."""

    node: str
    fabric_address: str
    fabric_interface: str
    ports: tuple[int, int]  # a block of this node's port range, inclusive
    gpus: tuple[int, ...]  # the CUDA devices this replica has there

    def port(self, offset: int) -> int:
        return self.ports[0] + offset


@dataclass(frozen=True)
class Step:
    """One process to run: on which node, as what, with what argv and environment, and
    what must be true before it starts (for the runtime and for `llmgw replicas`)."""

    node: str
    role: str  # HEAD, WORKER or SERVE
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    after: str = ""


def ports_needed(member: Member) -> int:
    return WORKERS_FROM + len(member.gpus) + SPARE_WORKER_PORTS


def _check(members: list[Member], tensor_parallel: int, pipeline_parallel: int) -> None:
    if not members:
        raise EngineError("a multi-node vLLM replica needs at least one node")
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise EngineError("tensor_parallel and pipeline_parallel must be at least 1")
    gpus = sum(len(m.gpus) for m in members)
    if gpus != tensor_parallel * pipeline_parallel:
        raise EngineError(
            f"tensor_parallel {tensor_parallel} × pipeline_parallel {pipeline_parallel}"
            f" needs {tensor_parallel * pipeline_parallel} GPUs; the nodes give {gpus}"
        )
    for m in members:
        if not m.fabric_address or m.fabric_address in ("0.0.0.0", "::"):
            raise EngineError(f"node {m.node}: agent.fabric_address is not set to an address")
        if not m.fabric_interface:
            raise EngineError(f"node {m.node}: agent.fabric_interface is not set")
        have = m.ports[1] - m.ports[0] + 1
        if have < ports_needed(m):
            raise EngineError(
                f"node {m.node}: ports {m.ports[0]}-{m.ports[1]} are {have};"
                f" Ray and vLLM need {ports_needed(m)} there"
            )


def _env(m: Member, key: str = "") -> dict[str, str]:
    env = {
        "NCCL_SOCKET_IFNAME": m.fabric_interface,
        "GLOO_SOCKET_IFNAME": m.fabric_interface,
        # vLLM's workers on this node say this address to the others (vLLM's
        # multi-node docs: set it on every node before `ray start`).
        "VLLM_HOST_IP": m.fabric_address,
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in m.gpus),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if key:
        env["VLLM_API_KEY"] = key
    return env


def _ray_ports(m: Member) -> list[str]:
    return [
        "--node-ip-address", m.fabric_address,
        "--node-manager-port", str(m.port(NODE_MANAGER)),
        "--object-manager-port", str(m.port(OBJECT_MANAGER)),
        "--dashboard-agent-listen-port", str(m.port(AGENT_LISTEN)),
        "--dashboard-agent-grpc-port", str(m.port(AGENT_GRPC)),
        "--metrics-export-port", str(m.port(METRICS_EXPORT)),
        "--runtime-env-agent-port", str(m.port(RUNTIME_ENV)),
        "--min-worker-port", str(m.port(WORKERS_FROM)),
        "--max-worker-port", str(m.ports[1]),
        "--num-gpus", str(len(m.gpus)),
        # In the foreground: the agent supervises it like an engine (kill -9 it and the
        # replica is replaced whole), and it dies with its process group.
        "--block", "--disable-usage-stats",
    ]  # fmt: skip


def plan(venv: Path, launch: Launch, members: list[Member], tensor_parallel: int,
         pipeline_parallel: int, key: str = "") -> list[Step]:  # fmt: skip
    """The processes of one replica: the leader (members[0]) runs the Ray head and the
    server; every other member runs a Ray worker. `launch` is the leader's engine launch
    (its HTTP host and port come from the agent as for any shard); `key` is the engine
    key, passed in the environment, never argv (`ps` would show it)."""
    _check(members, tensor_parallel, pipeline_parallel)
    ray = str(venv / "bin" / "ray")
    leader = members[0]
    head_at = f"{leader.fabric_address}:{leader.port(GCS)}"
    steps = [Step(
        node=leader.node, role=HEAD,
        argv=[ray, "start", "--head", "--port", str(leader.port(GCS)),
              "--ray-client-server-port", str(leader.port(CLIENT_SERVER)),
              "--include-dashboard=false", *_ray_ports(leader)],
        env=_env(leader),
    )]  # fmt: skip
    for m in members[1:]:
        steps.append(Step(
            node=m.node, role=WORKER,
            argv=[ray, "start", "--address", head_at, *_ray_ports(m)],
            env=_env(m), after=f"tcp {head_at} accepts",
        ))  # fmt: skip
    served = replace(launch, gpus=tensor_parallel)
    argv = [*vllm_command(venv, served),
            "--pipeline-parallel-size", str(pipeline_parallel),
            "--distributed-executor-backend", "ray"]  # fmt: skip
    total = tensor_parallel * pipeline_parallel
    steps.append(Step(
        node=leader.node, role=SERVE, argv=argv,
        env={**_env(leader, key), "RAY_ADDRESS": head_at,
             "VLLM_PORT": str(leader.port(DIST_INIT))},
        after=f"ray cluster at {head_at} has {total} GPUs on {len(members)} nodes",
    ))  # fmt: skip
    return steps
