"""A fake `nvidia-smi`: `topo -m` prints a captured matrix from tests/fixtures/topology/
(X.topo.txt), and the GPU query (llmgw.topology.GPU_HEALTH_FIELDS) prints the GPUs given
or the box's recorded X.health.csv, so an agent on a machine without GPUs reports some.

`write` puts one first on PATH for a real agent; `runner` answers the same in process,
for a Probe (llmgw_agentd.topology.Probe(run=...)).
"""

import os
import sys
from pathlib import Path

FIX = Path(__file__).parent / "fixtures" / "topology"
MiB = 1 << 20
RECORDED = None  # `gpus=RECORDED`: the box's own X.health.csv

# Two healthy A100s joined by NVLink (the a100-nvlink-pair matrix), neither in MIG mode.
A100_PAIR = [
    "0, GPU-6d2f1a9e-c4b3-47d8-a5e0-2f9c8b1d7e36, NVIDIA A100-SXM4-80GB, 81920, 4, 0, 29, 0,"
    " 81916, No, No, Disabled, 61.37",
    "1, GPU-a9e3b7c1-58d2-4f0a-b6c4-e1d07f2a9b58, NVIDIA A100-SXM4-80GB, 81920, 4, 0, 30, 0,"
    " 81916, No, No, Disabled, [N/A]",
]


def topo_path(box: str) -> Path:
    return FIX / f"{box}.topo.txt"


def health_path(box: str) -> Path:
    return FIX / f"{box}.health.csv"


def recorded(box: str) -> list[str]:
    """The box's recorded query lines (X.health.csv)."""
    return [ln for ln in health_path(box).read_text().splitlines() if ln.strip()]


def runner(box: str, gpus: list[str] | None = RECORDED):
    """A Probe's `run` answering as the fake binary would; `run.calls` lists the calls."""
    calls = []

    def run(args: list[str]) -> str:
        calls.append(args)
        if args[:2] == ["topo", "-m"]:
            return topo_path(box).read_text()
        if args and args[0].startswith("--query-gpu="):
            return "\n".join(recorded(box) if gpus is None else gpus) + "\n"
        raise AssertionError(f"fake nvidia-smi: unknown arguments {args}")

    run.calls = calls
    return run


def write(bindir: Path, box: str = "a100-nvlink-pair",
          gpus: list[str] | None = A100_PAIR) -> str:  # fmt: skip
    """Write bindir/nvidia-smi serving `box`'s matrix and `gpus` (RECORDED: the box's
    health.csv); returns a PATH with bindir first."""
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "nvidia-smi"
    query = (
        f"    sys.stdout.write(open({str(health_path(box))!r}).read())\n"
        if gpus is None
        else f"    print({chr(10).join(gpus)!r})\n"
    )
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if sys.argv[1:3] == ['topo', '-m']:\n"
        f"    sys.stdout.write(open({str(topo_path(box))!r}).read())\n"
        "elif sys.argv[1].startswith('--query-gpu='):\n"
        f"{query}"
        "else:\n"
        "    sys.exit('fake nvidia-smi: unknown arguments ' + ' '.join(sys.argv[1:]))\n"
    )
    script.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"
