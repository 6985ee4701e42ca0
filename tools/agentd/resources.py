"""What this node has to offer: CPUs, memory and GPUs, detected or overridden in config.

`agent.cpus` (> 0) and `agent.memory_bytes` (> 0) replace what is detected; with
`memory_bytes` set, memory available is that figure minus what our shards use, so tests
and small nodes can pretend to a fixed budget. `agent.gpus` is -1 (detect with
nvidia-smi) or 0 (report none: keep the cards for something else). The CUDA toolkit
(`find_nvcc`) decides whether an engine build here can use those GPUs.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

from llmgw import log
from llmgw.config import AgentConfig

_log = log.get("llmgw.agentd.resources")

GPU_QUERY = [
    "--query-gpu=index,name,memory.total,memory.free",
    "--format=csv,noheader,nounits",
]
# nvidia-smi takes a noticeable fraction of a second; free memory need not be fresher.
GPU_CACHE_S = 10.0
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


def parse_gpus(text: str) -> list[dict]:
    """GPUs from nvidia-smi's CSV (memory in MiB) as the bus reports them (bytes)."""
    gpus = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        try:
            total, free = int(float(cells[2])), int(float(cells[3]))
        except ValueError:
            continue
        gpus.append({
            "index": int(cells[0]), "name": cells[1],
            "memory_total": total * 1024 * 1024, "memory_free": free * 1024 * 1024,
        })  # fmt: skip
    return gpus


class Resources:
    def __init__(self, cfg: AgentConfig, meminfo: Path = Path("/proc/meminfo"),
                 disk: Path | None = None):  # fmt: skip
        self.cfg = cfg
        self.meminfo = meminfo
        self.disk = disk  # the state directory: where weights and engines go
        self._gpus: list[dict] = []
        self._gpus_at = -GPU_CACHE_S
        self._gpu_error = ""

    def gpus(self) -> list[dict]:
        if self.cfg.gpus == 0:
            return []
        now = time.monotonic()
        if now - self._gpus_at < GPU_CACHE_S:
            return self._gpus
        self._gpus_at = now
        binary = shutil.which("nvidia-smi")
        if not binary:
            self._gpus = []
            return self._gpus
        try:
            out = subprocess.run(
                [binary, *GPU_QUERY], capture_output=True, text=True, timeout=5, check=True
            ).stdout
            self._gpus = parse_gpus(out)
            error = ""
        except (OSError, subprocess.SubprocessError) as e:
            # A driver that went away must not take the agent with it: report no GPUs.
            self._gpus = []
            error = str(e)
        if error != self._gpu_error:
            if error:
                _log.warning("gpu_query_failed", reason=error)
            self._gpu_error = error
        return self._gpus

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
