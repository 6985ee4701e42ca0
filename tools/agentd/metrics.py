"""llmgw-agentd's Prometheus metrics, set from the agent's state at every heartbeat."""

from prometheus_client import Counter, Gauge

from llmgw_agentd import engines, supervisor

SHARDS = Gauge("llmgw_agent_shards", "Shards on this node by state", ["state"])
INSTALLS = Gauge(
    "llmgw_agent_engine_installs",
    "Engines by install state (1 = in that state)",
    ["engine", "state"],
)
MEMORY_AVAILABLE = Gauge("llmgw_agent_memory_available_bytes", "Memory available for shards")
MEMORY_TOTAL = Gauge(
    "llmgw_agent_memory_total_bytes", "Memory on this node (or agent.memory_bytes)"
)

REFUSED = Counter(
    "llmgw_agent_commands_refused_total",
    "Commands refused, by why (stale_epoch: from a scheduler that no longer leads)",
    ["reason"],
)
EPOCH = Gauge("llmgw_agent_leader_epoch", "The newest leader epoch this agent has seen")


def update(body: dict) -> None:
    """Set every gauge from a hello/heartbeat body."""
    counts = dict.fromkeys(supervisor.STATES, 0)
    for shard in body["shards"]:
        counts[shard["state"]] = counts.get(shard["state"], 0) + 1
    for state, n in counts.items():
        SHARDS.labels(state).set(n)
    for engine_id, install in body["engines"].items():
        for state in engines.STATES:
            INSTALLS.labels(engine_id, state).set(1 if install["state"] == state else 0)
    MEMORY_AVAILABLE.set(body["resources"]["memory_available"])
    MEMORY_TOTAL.set(body["resources"]["memory_total"])
    update_topology(body.get("topology"))
    update_gpus(body["resources"].get("gpus") or [], body["shards"])


# GPU health and fabric ports: what `nvidia-smi --query-gpu` and /sys/class/infiniband say.
# A figure the driver does not have ([N/A], [Not Supported]) has no sample, not a zero.
GPU_UTILIZATION = Gauge(
    "llmgw_agent_gpu_utilization_ratio", "GPU busy fraction over the driver's last sample",
    ["gpu", "uuid"],
)  # fmt: skip
GPU_TEMPERATURE = Gauge("llmgw_agent_gpu_temperature_celsius", "GPU core temperature",
                        ["gpu", "uuid"])  # fmt: skip
GPU_MEMORY_USED = Gauge("llmgw_agent_gpu_memory_used_bytes", "GPU memory in use",
                        ["gpu", "uuid"])  # fmt: skip
GPU_MEMORY_TOTAL = Gauge("llmgw_agent_gpu_memory_total_bytes", "GPU memory",
                         ["gpu", "uuid"])  # fmt: skip
GPU_ECC = Gauge(
    "llmgw_agent_gpu_ecc_uncorrected_errors",
    "Uncorrected ECC errors since the driver loaded (volatile)",
    ["gpu", "uuid"],
)  # fmt: skip
GPU_POWER = Gauge("llmgw_agent_gpu_power_watts", "Power the GPU draws", ["gpu", "uuid"])
GPU_HEALTHY = Gauge(
    "llmgw_agent_gpu_healthy",
    "1 if the GPU may be given work, 0 if its health says not (uncorrectable ECC errors,"
    " a page retirement or row remap waiting for a reset)",
    ["gpu", "uuid"],
)  # fmt: skip
# The replica is a label only here: the gauges above keep one series per GPU however
# often replicas come and go on it.
GPU_ASSIGNED = Gauge(
    "llmgw_agent_gpu_assigned", "1 for each GPU and the replica assigned it",
    ["gpu", "uuid", "model", "replica"],
)  # fmt: skip
IB_PORT_UP = Gauge(
    "llmgw_agent_ib_port_active", "1 if the port is ACTIVE with its link up",
    ["device", "port", "link_layer"],
)  # fmt: skip
IB_PORT_RATE = Gauge("llmgw_agent_ib_port_rate_bits_per_second", "The port's signalling rate",
                     ["device", "port", "link_layer"])  # fmt: skip

_GPU_GAUGES = (
    (GPU_UTILIZATION, "utilization", 0.01),
    (GPU_TEMPERATURE, "temperature", 1),
    (GPU_MEMORY_USED, "memory_used", 1),
    (GPU_MEMORY_TOTAL, "memory_total", 1),
    (GPU_ECC, "ecc_uncorrected", 1),
    (GPU_POWER, "power", 1),
)


def update_topology(report: dict | None) -> None:
    """Set the GPU and port gauges from the hello's `topology`; a GPU or port that is
    gone loses its samples."""
    report = report or {}
    for gauge, _, _ in _GPU_GAUGES:
        gauge.clear()
    for gpu in report.get("health") or []:
        labels = (str(gpu["index"]), gpu.get("uuid", ""))
        for gauge, key, scale in _GPU_GAUGES:
            if gpu.get(key) is not None:
                gauge.labels(*labels).set(gpu[key] * scale)
    IB_PORT_UP.clear()
    IB_PORT_RATE.clear()
    for port in report.get("infiniband") or []:
        labels = (port["device"], str(port["port"]), port.get("link_layer", ""))
        up = port.get("state") == "ACTIVE" and port.get("phys_state") == "LinkUp"
        IB_PORT_UP.labels(*labels).set(1 if up else 0)
        if port.get("rate_gbps") is not None:
            IB_PORT_RATE.labels(*labels).set(port["rate_gbps"] * 1e9)


def update_gpus(gpus: list[dict], shards: list[dict]) -> None:
    """Set each GPU's health and which replica holds it, from the heartbeat's
    `resources.gpus` and its shards (a stopped or failed shard holds none)."""
    GPU_HEALTHY.clear()
    GPU_ASSIGNED.clear()
    index = {}
    for gpu in gpus:
        index[gpu.get("uuid", "")] = str(gpu.get("index", ""))
        GPU_HEALTHY.labels(str(gpu.get("index", "")), gpu.get("uuid", "")).set(
            1 if gpu.get("healthy", True) else 0
        )
    for shard in shards:
        if shard["state"] in (supervisor.STOPPED, supervisor.FAILED):
            continue
        for uuid in shard.get("gpus") or ():
            GPU_ASSIGNED.labels(index.get(uuid, ""), uuid, shard.get("model", ""),
                                shard["id"]).set(1)  # fmt: skip
