"""The limit on open files, raised as far as a process may.

Every peer on the bus is a file descriptor: the scheduler holds one TCP connection per
agent and two per router, the router one per client and per engine. Under systemd's
default soft limit of 1,024 a scheduler stopped answering, its admin API included,
near a thousand agents (bench/fleet_scale.py showed the same at 150 agents under a
limit of 128). The units set LimitNOFILE; this covers a start outside systemd.
"""

import resource


def raise_open_files() -> int:
    """Raise the soft limit on open files to the hard one where allowed; the limit the
    process runs with."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # a sandbox that forbids it (SystemCallFilter=~@resources): the unit's
    return soft
