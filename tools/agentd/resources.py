"""What this node has to offer: CPUs, memory and GPUs, detected or overridden in config.

`agent.cpus` (> 0) and `agent.memory_bytes` (> 0) replace what is detected; with
`memory_bytes` set, memory available is that figure minus what our shards use, so tests
and small nodes can pretend to a fixed budget. `agent.gpus` is -1 (detect with
nvidia-smi) or 0 (report none: keep the cards for something else). The CUDA toolkit
(`find_nvcc`) decides whether an engine build here can use those GPUs.

A GPU is reported by UUID with its health (llmgw.topology.GpuHealth.problem): a card with
uncorrectable ECC errors or a retirement or row remap waiting for a reset is reported,
and the scheduler places nothing on it.
"""

import os
import shutil
from pathlib import Path

from llmgw.config import AgentConfig
from llmgw_agentd.topology import Probe

# Where the CUDA toolkit is when neither CUDA_HOME nor PATH says (NVIDIA's packages).
CUDA_ROOTS = ("/usr/local/cuda",)


def find_nvcc(env=os.environ, which=shutil.which, roots=CUDA_ROOTS) -> str:
    """The CUDA toolkit's compiler: $CUDA_HOME/bin/nvcc (or $CUDA_PATH's), nvcc on PATH,
    or under a usual root; "" where the toolkit is absent."""
    homes = [env.get("CUDA_HOME", ""), env.get("CUDA_PATH", "")]
    for home in homes:
        nvcc = Path(home) / "bin" / "nvcc"
        if home and os.access(nvcc, os.X_OK):
            return str(nvcc)
    found = which("nvcc", path=env.get("PATH", ""))
    if found:
        return found
    for root in roots:
        nvcc = Path(root) / "bin" / "nvcc"
        if os.access(nvcc, os.X_OK):
            return str(nvcc)
    return ""


def parse_meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from /proc/meminfo."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024  # kB
    total = values.get("MemTotal", 0)
    return total, values.get("MemAvailable", values.get("MemFree", 0))


class Resources:
    def __init__(self, cfg: AgentConfig, meminfo: Path = Path("/proc/meminfo"),
                 disk: Path | None = None, probe: Probe | None = None):  # fmt: skip
        self.cfg = cfg
        self.meminfo = meminfo
        self.disk = disk  # the state directory: where weights and engines go
        # GPUs come from the probe's one nvidia-smi query (cached, errors logged there).
        self.probe = probe or Probe(cfg)

    def gpus(self) -> list[dict]:
        """Each GPU by UUID: index, name, memory total and free, health, MIG mode."""
        return [g.resource() for g in self.probe.health()]

    def snapshot(self, shard_rss: int = 0) -> dict:
        """The `resources` body of hello and heartbeat. `shard_rss`: what our shards use."""
        if self.cfg.memory_bytes > 0:
            total = self.cfg.memory_bytes
            available = max(0, total - shard_rss)
        else:
            try:
                total, available = parse_meminfo(self.meminfo.read_text())
            except OSError:
                total = available = 0
        return {
            "cpus": self.cfg.cpus if self.cfg.cpus > 0 else (os.cpu_count() or 1),
            "memory_total": total,
            "memory_available": available,
            "gpus": self.gpus(),
            **self.disk_usage(),
        }

    def disk_usage(self) -> dict:
        """disk_total and disk_free of the state directory's file system (0: unknown)."""
        try:
            usage = shutil.disk_usage(self.disk) if self.disk else None
        except OSError:
            usage = None
        return {"disk_total": usage.total if usage else 0, "disk_free": usage.free if usage else 0}
