"""A GPU node's interconnect: parsers for what nvidia-smi and sysfs say, and the choice
of GPUs for a tensor-parallel group.

Pure functions over text and plain data: the agent runs the commands and reads sysfs
(tools/agentd/topology.py); tests feed captured outputs from tests/fixtures/topology/.

Link classes, best first (nvidia-smi's legend): NV# (a bonded set of # NVLinks), PIX
(at most one PCIe bridge), PXB (several PCIe bridges, no host bridge), PHB (a PCIe host
bridge, typically the CPU), NODE (between host bridges within a NUMA node), SYS (across
the SMP interconnect between NUMA nodes; older drivers say SOC). Tensor parallelism
exchanges activations at every layer, so the worst link in a group sets its pace.
"""

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.errors import Error


class TopologyError(Error):
    """Output of nvidia-smi or sysfs that cannot be read as a topology."""


# Lower is better. NV# ranks by its number of links (more links: more bandwidth).
PCIE_RANKS = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}
_NV = re.compile(r"^NV(\d+)$")
_AFFINITY_HEADERS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")


def link_rank(link: str) -> tuple[int, int]:
    """A sort key for a link class: smaller is faster. Raises TopologyError if unknown."""
    m = _NV.match(link)
    if m:
        return (0, -int(m.group(1)))
    if link in PCIE_RANKS:
        return (PCIE_RANKS[link], 0)
    raise TopologyError(f"unknown link class '{link}'")


def link_kind(link: str) -> str:
    """nvlink, pcie (through PCIe switches or a host bridge) or system (across NUMA)."""
    if _NV.match(link):
        return "nvlink"
    return "system" if link in ("SYS", "SOC") else "pcie"


@dataclass
class Topology:
    """What `nvidia-smi topo -m` says: GPU indices, the link between each pair of GPUs,
    NICs (by their real names, mlx5_0…) and each GPU's link to each NIC, and affinity."""

    gpus: list[int] = field(default_factory=list)
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j), i < j
    nics: list[str] = field(default_factory=list)
    nic_links: dict[tuple[int, str], str] = field(default_factory=dict)  # (gpu, nic)
    cpu_affinity: dict[int, str] = field(default_factory=dict)  # "0-55,112-167"
    numa_affinity: dict[int, str] = field(default_factory=dict)  # "0", or "N/A"

    def link(self, a: int, b: int) -> str:
        return self.links[(min(a, b), max(a, b))]

    def as_dict(self) -> dict:
        """JSON-shaped, as the agent reports it: links as "i-j" keys."""
        return {
            "gpus": self.gpus,
            "links": {f"{a}-{b}": v for (a, b), v in sorted(self.links.items())},
            "nics": self.nics,
            "nic_links": {f"{g}-{n}": v for (g, n), v in sorted(self.nic_links.items())},
            "cpu_affinity": {str(k): v for k, v in self.cpu_affinity.items()},
            "numa_affinity": {str(k): v for k, v in self.numa_affinity.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Topology":
        """The inverse of as_dict (what the scheduler receives)."""

        def pair(key: str) -> tuple[str, str]:
            a, _, b = key.partition("-")
            return a, b

        links = {}
        for key, v in d.get("links", {}).items():
            a, b = pair(key)
            links[(int(a), int(b))] = v
        nic_links = {}
        for key, v in d.get("nic_links", {}).items():
            g, n = pair(key)
            nic_links[(int(g), n)] = v
        return cls(
            gpus=[int(g) for g in d.get("gpus", [])],
            links=links,
            nics=list(d.get("nics", [])),
            nic_links=nic_links,
            cpu_affinity={int(k): v for k, v in d.get("cpu_affinity", {}).items()},
            numa_affinity={int(k): v for k, v in d.get("numa_affinity", {}).items()},
        )


def _cells(line: str) -> list[str]:
    """Cells of a matrix line: newer drivers separate them with tabs (padding " X "),
    older ones align them with runs of spaces ("CPU Affinity" holds a single space)."""
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return [c.strip() for c in re.split(r"\s{2,}", line.rstrip())]


def parse_topo_matrix(text: str) -> Topology:
    """Parse `nvidia-smi topo -m`.

    Device columns are GPU<i>, NIC<i> (named in the "NIC Legend" that newer drivers
    print below the matrix) or a NIC's own name (mlx5_0, older drivers). The affinity
    columns follow the devices; NIC rows have none.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header_at = next((i for i, ln in enumerate(lines) if re.match(r"^\s+GPU\d+\b", ln)), None)
    if header_at is None:
        raise TopologyError("no matrix header (a line starting with GPU0) in nvidia-smi topo -m")
    header = [c for c in _cells(lines[header_at]) if c]
    devices = [c for c in header if c not in _AFFINITY_HEADERS]
    extras = [c for c in header if c in _AFFINITY_HEADERS]
    if header[: len(devices)] != devices:
        raise TopologyError(f"affinity columns before device columns: {lines[header_at]!r}")
    legend = {}
    for ln in lines[header_at + 1 :]:
        m = _NIC_LEGEND.match(ln)
        if m:
            legend[m.group(1)] = m.group(2)
    topo = Topology()

    def name(dev: str) -> str:
        return legend.get(dev, dev)

    rows: dict[str, list[str]] = {}
    for ln in lines[header_at + 1 :]:
        if ln.startswith("Legend") or ln.startswith("NIC Legend"):
            break
        cells = _cells(ln)
        label = cells[0]
        if label not in devices:
            raise TopologyError(f"matrix row for unknown device '{label}': {ln!r}")
        values = cells[1:]
        if len(values) < len(devices):
            raise TopologyError(
                f"row {label} has {len(values)} cells, expected {len(devices)}: {ln!r}"
            )
        rows[label] = values
    gpu_cols = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    topo.gpus = [int(d[3:]) for d in gpu_cols]
    topo.nics = [name(d) for d in devices if d not in gpu_cols]
    for d in gpu_cols:
        if d not in rows:
            raise TopologyError(f"no matrix row for {d}")
    for d in gpu_cols:
        i = int(d[3:])
        values = rows[d]
        for col, v in zip(devices, values[: len(devices)], strict=True):
            if col == d:
                if v != "X":
                    raise TopologyError(f"{d} to itself is '{v}', expected X")
                continue
            link_rank(v)  # refuses unknown classes
            if col in gpu_cols:
                j = int(col[3:])
                key = (min(i, j), max(i, j))
                if key in topo.links and topo.links[key] != v:
                    raise TopologyError(f"{d}-{col} is {v} one way and {topo.links[key]} back")
                topo.links[key] = v
            else:
                topo.nic_links[(i, name(col))] = v
        rest = [v for v in values[len(devices) :] if v]
        for head, v in zip(extras, rest, strict=False):
            if head == "CPU Affinity":
                topo.cpu_affinity[i] = v
            elif head == "NUMA Affinity":
                topo.numa_affinity[i] = v
    return topo


# --------------------------------------------------------------------------------------
# nvidia-smi --query-gpu

# One query for what the scheduler places by (identity, free memory, health, MIG) and
# what the metrics show. The first nine fields are as old as any supported driver; a
# driver that refuses the rest (remapped rows came with Ampere's drivers) is asked for
# GPU_BASIC_FIELDS instead, and what it could not say is unknown (power.draw included:
# it is only shown, never placed by).
GPU_HEALTH_FIELDS = (
    "index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu",
    "temperature.gpu", "ecc.errors.uncorrected.volatile.total", "memory.free",
    "retired_pages.pending", "remapped_rows.pending", "mig.mode.current", "power.draw",
)  # fmt: skip
GPU_BASIC_FIELDS = GPU_HEALTH_FIELDS[:9]


def gpu_query(fields: tuple[str, ...] = GPU_HEALTH_FIELDS) -> list[str]:
    return ["--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"]


GPU_HEALTH_QUERY = gpu_query()
_MISSING = ("[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "[GPU is lost]")
_YES, _NO = ("yes", "true", "1"), ("no", "false", "0")


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's state; None where the driver has no figure ([N/A], [Not Supported])."""

    index: int
    uuid: str
    name: str
    memory_total: int | None  # bytes
    memory_used: int | None
    utilization: float | None  # percent
    temperature: float | None  # °C
    ecc_uncorrected: int | None  # since the driver loaded
    memory_free: int | None = None
    retired_pages_pending: bool | None = None  # a page waits for a reset to be retired
    remapped_rows_pending: bool | None = None  # a row remap waits for a reset
    mig: str = ""  # mig.mode.current: "Enabled", "Disabled", "" (not known / no MIG)
    power: float | None = None  # watts drawn (power.draw)

    @property
    def problem(self) -> str:
        """Why it should not be given work ("" when nothing says so: an unknown figure is
        not a fault, or every GeForce card would be unusable)."""
        why = []
        if self.ecc_uncorrected:
            n = self.ecc_uncorrected
            why.append(f"{n} uncorrectable ECC error{'s' * (n != 1)}")
        if self.retired_pages_pending:
            why.append("retired pages pending (needs a GPU reset)")
        if self.remapped_rows_pending:
            why.append("row remapping pending (needs a GPU reset)")
        return "; ".join(why)

    def as_dict(self) -> dict:
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name,
            "memory_total": self.memory_total, "memory_used": self.memory_used,
            "utilization": self.utilization, "temperature": self.temperature,
            "ecc_uncorrected": self.ecc_uncorrected, "memory_free": self.memory_free,
            "retired_pages_pending": self.retired_pages_pending,
            "remapped_rows_pending": self.remapped_rows_pending, "mig": self.mig,
            "power": self.power,
        }  # fmt: skip

    def resource(self) -> dict:
        """The GPU as the agent's `resources.gpus` reports it, for placement."""
        problem = self.problem
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name,
            "memory_total": self.memory_total or 0, "memory_free": self.memory_free or 0,
            "healthy": not problem, "health": problem, "mig": self.mig,
        }  # fmt: skip


def _number(cell: str, what: str, line: str) -> float | None:
    if cell in _MISSING:
        return None
    try:
        return float(cell)
    except ValueError:
        raise TopologyError(f"{what} is '{cell}', not a number: {line!r}") from None


def _flag(cell: str | None) -> bool | None:
    if cell is None or cell in _MISSING:
        return None
    if cell.lower() in _YES:
        return True
    if cell.lower() in _NO:
        return False
    return None  # a word a newer driver may use: unknown, never a fault


def _mib(cell: str | None, what: str, line: str) -> int | None:
    value = None if cell is None else _number(cell, what, line)
    return None if value is None else int(value) * 1024 * 1024


def parse_gpu_health(text: str, fields: tuple[str, ...] = GPU_HEALTH_FIELDS) -> list[GpuHealth]:
    """Parse `nvidia-smi` with gpu_query(fields) (CSV, no header, no units; memory MiB)."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            raise TopologyError(
                f"expected {len(fields)} fields ({','.join(fields)}), got {len(cells)}: {line!r}"
            )
        row = dict(zip(fields, cells, strict=True))
        if not row["index"].isdigit():
            raise TopologyError(f"GPU index is '{row['index']}': {line!r}")
        ecc = _number(row["ecc.errors.uncorrected.volatile.total"],
                      "ecc.errors.uncorrected.volatile.total", line)  # fmt: skip
        mig = row.get("mig.mode.current", "")
        out.append(GpuHealth(
            index=int(row["index"]), uuid=row["uuid"], name=row["name"],
            memory_total=_mib(row["memory.total"], "memory.total", line),
            memory_used=_mib(row["memory.used"], "memory.used", line),
            utilization=_number(row["utilization.gpu"], "utilization.gpu", line),
            temperature=_number(row["temperature.gpu"], "temperature.gpu", line),
            ecc_uncorrected=None if ecc is None else int(ecc),
            memory_free=_mib(row.get("memory.free"), "memory.free", line),
            retired_pages_pending=_flag(row.get("retired_pages.pending")),
            remapped_rows_pending=_flag(row.get("remapped_rows.pending")),
            mig="" if mig in _MISSING else mig,
            power=_number(row.get("power.draw", "[N/A]"), "power.draw", line),
        ))  # fmt: skip
    return out


# --------------------------------------------------------------------------------------
# /sys/class/infiniband


@dataclass(frozen=True)
class IbPort:
    """One port of an RDMA device (InfiniBand, or RoCE when link_layer is Ethernet)."""

    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED
    phys_state: str  # LinkUp, Polling, Disabled
    rate_gbps: float | None  # 400.0 for "400 Gb/sec (4X NDR)"
    link_layer: str  # InfiniBand or Ethernet

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE" and self.phys_state == "LinkUp"

    def as_dict(self) -> dict:
        return {
            "device": self.device, "port": self.port, "state": self.state,
            "phys_state": self.phys_state, "rate_gbps": self.rate_gbps,
            "link_layer": self.link_layer,
        }  # fmt: skip


def _enum(text: str) -> str:
    """sysfs says "4: ACTIVE" and "5: LinkUp": the name after the number."""
    _, sep, name = text.strip().partition(":")
    return name.strip() if sep else text.strip()


def parse_ib_rate(text: str) -> float | None:
    """Gb/s from "200 Gb/sec (4X HDR)"; None for an empty or unknown rate."""
    m = re.match(r"^\s*([\d.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else None


def read_ib_ports(root: Path) -> list[IbPort]:
    """Every port under `root` (/sys/class/infiniband). No directory: no ports.

    A port directory missing `state` is reported as an error naming the file: a sysfs
    that says half of it would otherwise read as a port that is down.
    """
    if not root.is_dir():
        return []
    ports = []
    for dev in sorted(root.iterdir()):
        pdir = dev / "ports"
        if not pdir.is_dir():
            continue
        for p in sorted(pdir.iterdir(), key=lambda p: (len(p.name), p.name)):
            if not p.name.isdigit():
                continue

            def read(name: str, required: bool = True, p: Path = p) -> str:
                try:
                    return (p / name).read_text().strip()
                except OSError as e:
                    if required:
                        raise TopologyError(f"cannot read {p / name}: {e.strerror}") from None
                    return ""

            ports.append(IbPort(
                device=dev.name, port=int(p.name), state=_enum(read("state")),
                phys_state=_enum(read("phys_state", False)),
                rate_gbps=parse_ib_rate(read("rate", False)),
                link_layer=read("link_layer", False) or "InfiniBand",
            ))  # fmt: skip
    return ports


# --------------------------------------------------------------------------------------
# Choosing GPUs for a tensor-parallel group

# Past this many candidate groups, choose greedily (16 GPUs choose 8 is 12,870).
_EXHAUSTIVE_MAX = 20_000


@dataclass(frozen=True)
class GpuChoice:
    """The GPUs for one group, the worst link between any two of them ("" for one GPU),
    and a sentence for explain-placement."""

    gpus: tuple[int, ...]
    link: str
    why: str


def _score(topo: Topology, group: tuple[int, ...]) -> tuple:
    links = [link_rank(topo.link(a, b)) for a, b in itertools.combinations(group, 2)]
    # Older drivers print no NUMA column: the CPU affinity names the socket as well.
    numas = {topo.numa_affinity.get(g) or topo.cpu_affinity.get(g, "") for g in group}
    # The worst link first (it paces every all-reduce), then the sum (fewer slow pairs),
    # then one NUMA node, then the lowest indices (stable, readable choices).
    return (max(links), sum(r for r, _ in links), len(numas), group)


def choose_gpus(topo: Topology, free: list[int], n: int) -> GpuChoice | None:
    """Choose `n` of the `free` GPU indices for one tensor-parallel group.

    GPUs joined by NVLink where there are (more bonded links preferred), else the best
    PCIe class (PIX before PXB before PHB before NODE before SYS); among equals, those
    on one NUMA node. None when fewer than `n` are free. A GPU missing from the matrix
    (nvidia-smi listed it but topo -m did not) is treated as joined to the others by SYS.
    """
    free = sorted(set(free))
    if n <= 0 or len(free) < n:
        return None
    if n == 1:
        return GpuChoice((free[0],), "", f"GPU {free[0]} alone")
    known = set(topo.gpus)
    # A topology without some GPUs: complete it pessimistically rather than fail.
    full = Topology(
        gpus=sorted(known | set(free)),
        links=dict(topo.links),
        cpu_affinity=dict(topo.cpu_affinity),
        numa_affinity=dict(topo.numa_affinity),
    )
    for a, b in itertools.combinations(full.gpus, 2):
        full.links.setdefault((a, b), "SYS")
    combos = 1
    for k in range(n):
        combos = combos * (len(free) - k) // (k + 1)
    if combos <= _EXHAUSTIVE_MAX:
        best = min(itertools.combinations(free, n), key=lambda g: _score(full, g))
    else:
        best = _greedy(full, free, n)
    worst = max((full.link(a, b) for a, b in itertools.combinations(best, 2)), key=link_rank)
    names = ",".join(str(g) for g in best)
    return GpuChoice(best, worst, f"GPUs {names} joined by {worst} ({link_kind(worst)})")


def _greedy(topo: Topology, free: list[int], n: int) -> tuple[int, ...]:
    """From each starting GPU, add the GPU whose worst link to the group is best."""
    best = None
    for start in free:
        group = [start]
        while len(group) < n:
            rest = [g for g in free if g not in group]
            group.append(min(rest, key=lambda g: (
                max(link_rank(topo.link(g, h)) for h in group), g)))  # fmt: skip
        cand = tuple(sorted(group))
        if best is None or _score(topo, cand) < _score(topo, best):
            best = cand
    return best
