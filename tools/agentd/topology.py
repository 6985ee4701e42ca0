"""This node's GPU interconnect, InfiniBand ports and GPU health, as the agent reports them.

The parsing is llmgw.topology's; here are the edges: running nvidia-smi, reading sysfs,
caching. A node without nvidia-smi or /sys/class/infiniband reports none of either and
logs nothing: that is every CPU node, not a fault. A driver that answers with an error
or with output we cannot read is logged once per change and reported as none, so a
broken driver never takes the agent with it.
"""

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from llmgw import log, topology
from llmgw.config import AgentConfig

_log = log.get("llmgw.agentd.topology")

# The matrix changes only when cards are added or links fail: once a minute is plenty.
TOPO_CACHE_S = 60.0
HEALTH_CACHE_S = 10.0
IB_ROOT = Path("/sys/class/infiniband")

Runner = Callable[[list[str]], str]


def run_nvidia_smi(args: list[str]) -> str:
    """nvidia-smi's stdout; "" when there is no nvidia-smi. Raises on failure."""
    binary = shutil.which("nvidia-smi")
    if not binary:
        return ""
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout


class Probe:
    """Cached readings of the node's GPUs and fabric; `report()` is the hello's `topology`."""

    def __init__(self, cfg: AgentConfig, run: Runner = run_nvidia_smi, ib_root: Path = IB_ROOT,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.cfg = cfg
        self.run = run
        self.ib_root = ib_root
        self.clock = clock
        self._cache: dict[str, tuple[float, object]] = {}
        self._errors: dict[str, str] = {}
        self._fields = topology.GPU_HEALTH_FIELDS

    def _cached(self, what: str, ttl: float, read: Callable[[], object], empty: object):
        now = self.clock()
        hit = self._cache.get(what)
        if hit is not None and now - hit[0] < ttl:
            return hit[1]
        try:
            value, error = read(), ""
        except subprocess.CalledProcessError as e:
            said = (e.stderr or e.stdout or "").strip().splitlines()
            value, error = empty, f"nvidia-smi exited {e.returncode}: {said[0] if said else ''}"
        except (OSError, subprocess.SubprocessError, topology.TopologyError) as e:
            value, error = empty, str(e).splitlines()[0] if str(e) else type(e).__name__
        if error != self._errors.get(what, ""):
            if error:
                _log.warning("probe_failed", what=what, reason=error)
            else:
                _log.info("probe_recovered", what=what)
            self._errors[what] = error
        self._cache[what] = (now, value)
        return value

    def _gpus_off(self) -> bool:
        return self.cfg.gpus == 0

    def matrix(self) -> topology.Topology | None:
        if self._gpus_off():
            return None

        def read():
            out = self.run(["topo", "-m"])
            return topology.parse_topo_matrix(out) if out.strip() else None

        return self._cached("topo", TOPO_CACHE_S, read, None)

    def health(self) -> list[topology.GpuHealth]:
        """Every GPU with its identity, memory and health: the one nvidia-smi query that
        both `resources.gpus` (placement) and the health report (metrics) come from."""
        if self._gpus_off():
            return []

        def read():
            try:
                out = self.run(topology.gpu_query(self._fields))
            except subprocess.CalledProcessError:
                if self._fields == topology.GPU_BASIC_FIELDS:
                    raise
                # An older driver refuses a field it does not know, and with it the whole
                # query: ask for the basic fields from now on, leaving the rest unknown.
                out = self.run(topology.gpu_query(topology.GPU_BASIC_FIELDS))
                self._fields = topology.GPU_BASIC_FIELDS
                _log.warning("gpu_health_fields_unsupported",
                             fields=",".join(topology.GPU_HEALTH_FIELDS[9:]))  # fmt: skip
            return topology.parse_gpu_health(out, self._fields)

        return self._cached("health", HEALTH_CACHE_S, read, [])

    def ib_ports(self) -> list[topology.IbPort]:
        return self._cached("infiniband", HEALTH_CACHE_S,
                            lambda: topology.read_ib_ports(self.ib_root), [])  # fmt: skip

    def fabric(self) -> dict:
        return {
            "label": self.cfg.fabric,
            "address": self.cfg.fabric_address,
            "interface": self.cfg.fabric_interface,
        }

    def report(self) -> dict:
        """{matrix, infiniband, health, fabric}: matrix None where there is no nvidia-smi."""
        matrix = self.matrix()
        return {
            "matrix": matrix.as_dict() if matrix is not None else None,
            "infiniband": [p.as_dict() for p in self.ib_ports()],
            "health": [g.as_dict() for g in self.health()],
            "fabric": self.fabric(),
        }
