"""From `llmgw nodes onboard` to the node's first hello, against the install alone.

    .venv/bin/python bench/onboard.py [--runs 2]

Runs the real scheduler (HTTPS admin API, the tests' Cluster helper) and a real sshd on
loopback (tests/sshd.py; needs root and openssh-server), publishes a wheel of this tree
and times `llmgw nodes onboard` to a fresh node until its hello. The baseline, in the
same run, is what no onboarding can skip: `python3 -m venv` and `pip install` of the
same wheel over the same ssh. The difference is what llmgw adds (checks, the join, the
start, waiting for the hello). Writes bench/ONBOARD.md.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llmgw  # noqa: E402
from tests.sshd import Sshd, available  # noqa: E402
from tests.system.conftest import Cluster  # noqa: E402
from tests.system.test_onboard import Node, build_wheel  # noqa: E402
from tests.system.test_tls import certmon  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    if not available():
        sys.exit("bench/onboard.py needs root and /usr/sbin/sshd (apt-get install openssh-server)")
    onboard, install = [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as d:
        tmp = Path(d)
        os.environ["LLMGW_STORE"] = f"sqlite://{tmp}/llmgw.db"
        cluster = Cluster(tmp)
        pki = certmon(cluster.etc, "init-ca")
        certmon(cluster.etc, "issue", "localhost", "--san", "127.0.0.1")
        cluster.scheduler_extra = (f'admin_tls_cert = "{pki / "localhost.crt"}"\n'
                                   f'admin_tls_key = "{pki / "localhost.key"}"\n')  # fmt: skip
        cluster.admin_scheme = "https"
        sshd = Sshd(tmp)
        nodes = []
        try:
            cluster.start_scheduler()
            wheel = build_wheel(tmp, llmgw.__version__)
            assert cluster.ctl("release", "publish", str(wheel)).returncode == 0
            for i in range(args.runs):
                venv = tmp / f"baseline-{i}"
                cmd = (f"python3 -m venv {venv} && {venv}/bin/pip install --quiet"
                       f" --disable-pip-version-check {shlex.quote(str(wheel))}")  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(["ssh", "-o", "BatchMode=yes", "-o",
                                f"UserKnownHostsFile={sshd.known_hosts}", "-i", str(sshd.key),
                                "-p", str(sshd.port), f"{sshd.user}@127.0.0.1", cmd],
                               check=True, capture_output=True)  # fmt: skip
                install.append(time.perf_counter() - t0)
                node = Node(tmp, f"node-{i}")
                nodes.append(node)
                t0 = time.perf_counter()
                r = cluster.ctl("nodes", "onboard", node.name, *sshd.ssh_args(), *node.args(),
                                "--json")  # fmt: skip
                onboard.append(time.perf_counter() - t0)
                assert r.returncode == 0, r.stderr
                assert json.loads(r.stdout)["state"] == "up"
        finally:
            for node in nodes:
                node.stop()
            sshd.stop()
            cluster.stop()
    med_o, med_i = statistics.median(onboard), statistics.median(install)
    lines = [
        "# Onboarding: `llmgw nodes onboard` to the node's first hello",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M}Z, {args.runs} fresh nodes over a real sshd on"
        f" loopback, llmgw {llmgw.__version__} from the release directory ({os.cpu_count()}"
        " CPUs; pip's cache warm).",
        "",
        "| | median s | runs | vs install |",
        "|---|---|---|---|",
        f"| venv + pip install over ssh (baseline) | {med_i:.1f} |"
        f" {', '.join(f'{t:.1f}' for t in install)} | 1.00 |",
        f"| `llmgw nodes onboard` until hello | {med_o:.1f} |"
        f" {', '.join(f'{t:.1f}' for t in onboard)} | {med_o / med_i:.2f} |",
        "",
        f"What llmgw adds to the install: {med_o - med_i:.1f} s (checks, join, start, hello).",
    ]
    text = "\n".join(lines) + "\n"
    (ROOT / "bench" / "ONBOARD.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
