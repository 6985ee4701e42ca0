"""Run a command and write its output with each line prefixed by the wall-clock time
(`1712345678.123 `), as journald would keep it: the tools log no time of their own, and
the partition invariants compare when things happened on different hosts.

    python stamp.py COMMAND [ARG...]

SIGTERM and SIGINT are passed to the command; its exit status is this one's.
"""

import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    out = sys.stdout.buffer
    for line in child.stdout:
        out.write(b"%.3f " % time.time() + line)
        out.flush()
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
