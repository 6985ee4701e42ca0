"""A fake `nvidia-smi` to put first on PATH: `topo -m` prints a captured matrix from
tests/fixtures/topology/, and the GPU query (llmgw.topology.GPU_HEALTH_FIELDS) prints
the GPUs given, so an agent on a machine without GPUs reports some."""

import os
import sys
from pathlib import Path

FIX = Path(__file__).parent / "fixtures" / "topology"
MiB = 1 << 20

# Two healthy A100s joined by NVLink (the a100-nvlink-pair matrix), neither in MIG mode.
A100_PAIR = [
    "0, GPU-6d2f1a9e-c4b3-47d8-a5e0-2f9c8b1d7e36, NVIDIA A100-SXM4-80GB, 81920, 4, 0, 29, 0,"
    " 81916, No, No, Disabled, 61.37",
    "1, GPU-a9e3b7c1-58d2-4f0a-b6c4-e1d07f2a9b58, NVIDIA A100-SXM4-80GB, 81920, 4, 0, 30, 0,"
    " 81916, No, No, Disabled, [N/A]",
]


def write(bindir: Path, box: str = "a100-nvlink-pair", gpus: list[str] = A100_PAIR) -> str:
    """Write bindir/nvidia-smi; returns a PATH with bindir first."""
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "if sys.argv[1:3] == ['topo', '-m']:\n"
        f"    sys.stdout.write(open({str(FIX / (box + '.topo.txt'))!r}).read())\n"
        "elif sys.argv[1].startswith('--query-gpu='):\n"
        f"    print({chr(10).join(gpus)!r})\n"
        "else:\n"
        "    sys.exit('fake nvidia-smi: unknown arguments ' + ' '.join(sys.argv[1:]))\n"
    )
    script.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"
