"""Engine processes seen through /proc, so the agent can watch ones it did not start.

After an agent restart its engines are no longer its children: there is no exit status
to wait for, and a pid may by then belong to something else. A process is identified
by its pid *and* its start time (field 22 of /proc/PID/stat), which together never
repeat while the machine is up.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return text[text.rfind(")") + 2 :].split()


def create_time(pid: int) -> int:
    """The process's start time in clock ticks since boot; 0 if there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else 0


def alive(pid: int, started: int) -> bool:
    """Is the process that had this pid and start time still running (not a zombie)?"""
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return int(fields[19]) == started


def _vm_rss(pid: int) -> int:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss(pid: int) -> int:
    """Resident memory in bytes (VmRSS) of the process and of the others in the group it
    leads (an engine is started in its own session: vLLM's engine core is a process of
    its own, holding the weights and the KV cache); 0 when the process is gone."""
    own = _vm_rss(pid)
    if not own:
        return 0
    total = own
    for p in PROC.iterdir():
        if not p.name.isdigit() or int(p.name) == pid:
            continue
        fields = _stat_fields(int(p.name))
        if fields and len(fields) > 2 and fields[2] == str(pid):
            total += _vm_rss(int(p.name))
    return total


def signal_group(pid: int, sig: int) -> bool:
    """Signal the process group an engine leads (it was started in its own session)."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def terminate(pid: int, started: int, grace_s: float, wait=None) -> None:
    """SIGTERM the group, SIGKILL it after `grace_s`. `wait(timeout)` reaps our own child."""
    signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if wait is not None:
            try:
                wait(0.1)
                break
            except subprocess.TimeoutExpired:
                continue
        if not alive(pid, started):
            break
        time.sleep(0.1)
    # Also whatever the engine left behind in its group (workers, a shell's children).
    signal_group(pid, signal.SIGKILL)
    if wait is not None:
        try:
            wait(5)
        except subprocess.TimeoutExpired:
            pass  # unkillable (D state): nothing more to do from here


def port_free(port: int) -> bool:
    """Can a server bind `port` on every interface right now?"""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
