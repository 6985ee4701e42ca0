"""py-spy sampling of a running process, summarised as the functions with most own time."""

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

PY_SPY = Path(sys.executable).parent / "py-spy"
_LINE = re.compile(r":\d+\)$")
_PREFIX = re.compile(r"^.*?(site-packages/|python3\.\d+/)")
_ROOT = str(Path(__file__).resolve().parent.parent) + "/"


def ensure_py_spy() -> Path:
    """py-spy in the project's venv, pip-installed there on first use."""
    if not PY_SPY.exists():
        print("  installing py-spy into the venv", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "py-spy"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return PY_SPY


def record(pid: int, seconds: int, out: Path, log: Path, rate: int = 500) -> subprocess.Popen:
    """Start py-spy sampling pid for `seconds`, writing collapsed stacks to out."""
    cmd = [
        str(ensure_py_spy()), "record", "--nonblocking", "-r", str(rate), "-d", str(seconds),
        "--format", "raw", "-o", str(out), "--pid", str(pid),
    ]  # fmt: skip
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def own_time(raw: Path, top: int = 15) -> tuple[int, list[tuple[str, int]]]:
    """(total samples, the `top` leaf functions by samples) from py-spy's raw output.

    Each raw line is `frame;frame;...;leaf COUNT`, a frame `function (file:line)`; the
    line number is dropped so that a function's samples add up."""
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = _LINE.sub(")", stack.rsplit(";", 1)[-1])
        own[_shorten(leaf)] += int(count)
        total += int(count)
    return total, own.most_common(top)


def _shorten(frame: str) -> str:
    """`fn (/long/path/site-packages/pkg/mod.py)` -> `fn (pkg/mod.py)`."""
    name, _, path = frame.partition(" (")
    path = path.rstrip(")")
    path = _PREFIX.sub("", path.removeprefix(_ROOT))
    return f"{name} ({path})" if path else name
