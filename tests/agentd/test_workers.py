"""Workers of a replica across nodes: the real rpc-server, only on the fabric address."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.config import AgentConfig
from llmgw.engines.llamacpp import leader_args, rpc_command
from llmgw_agentd.engines import Launch, llama_command
from llmgw_agentd.errors import AgentError
from llmgw_agentd.workers import Rank, fabric_host, listening, rank_of
from tests.agentd.conftest import NODE
from tests.helpers import ROOT, eventually

VERSION = "0.3.36"


@pytest.mark.parametrize(
    "address, words",
    [
        ("", "needs agent.fabric_address"),
        ("0.0.0.0", "every interface"),
        ("::", "every interface"),
        ("8.8.8.8", "public address"),
        ("fabric-a", "not an IP address"),
    ],
)
def test_a_worker_refuses_to_listen_anywhere_but_a_private_fabric_address(address, words):
    with pytest.raises(AgentError, match=words):
        fabric_host(AgentConfig(fabric_address=address))


@pytest.mark.parametrize("address", ["10.1.2.3", "192.168.0.7", "127.0.0.1", "fd00::5"])
def test_private_and_loopback_fabric_addresses_are_taken(address):
    assert fabric_host(AgentConfig(fabric_address=address)) == address


def test_the_leader_drives_its_workers_with_every_layer_split_by_their_parts():
    workers = ("10.0.0.1:50052", "10.0.0.2:50052")
    launch = Launch("/m.gguf", "127.0.0.1", 8011, "/k", 2048, 2, served_name="big",
                    rpc=workers, tensor_split=(0.75, 0.25))  # fmt: skip
    argv = llama_command(Path("/bin/llama-server"), launch)
    joined = " ".join(argv)
    assert "--rpc 10.0.0.1:50052,10.0.0.2:50052" in joined
    assert "--tensor-split 0.75,0.25" in joined
    assert "-ngl 99" in joined
    plain = llama_command(Path("/bin/llama-server"), Launch("/m.gguf", "h", 1, "/k", 512, 1))
    assert "--rpc" not in plain and "-ngl" not in plain
    assert leader_args(["a:1"], []) == ["--rpc", "a:1", "-ngl", "99"]
    assert rpc_command("/rpc-server", "10.0.0.1", 50052, 0)[-2:] == ["-t", "1"]


def rpc_server_binary() -> Path:
    """The cached rpc-server (`make test` built it with `make engine`, so this is quick)."""
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run([str(ROOT / "scripts" / "build-llama-server")], env=env,
                         stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip()).with_name("rpc-server")


def worker_body(shard_id: str) -> dict:
    return {"id": shard_id, "model": "big", "profile": "p1", "engine": "llama.cpp",
            "engine_version": VERSION, "role": "rpc-worker", "threads": 1}  # fmt: skip


def test_a_worker_shard_runs_rpc_server_on_the_fabric_address_and_is_adopted(scheduler, node):
    assert rpc_server_binary().exists()
    first = node.start(fabric_address="127.0.0.1")
    scheduler.wait("hello")
    scheduler.send(NODE, "start_shard", worker_body("r-1.w0"))
    shard = node.remember(scheduler.wait_shard("r-1.w0", "ready", timeout=60))
    assert shard["role"] == "rpc-worker"
    assert shard["endpoint"] == f"127.0.0.1:{shard['port']}"
    assert listening(shard["endpoint"])
    cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().split(b"\0")
    assert Path(cmdline[0].decode()).name == "rpc-server"
    assert cmdline[cmdline.index(b"-H") + 1] == b"127.0.0.1"
    state = json.loads((node.state / "shards" / "r-1.w0.json").read_text())
    assert state["role"] == "rpc-worker"

    # The agent dies; the worker does not, and the next agent adopts it as a worker.
    first.stop(signal.SIGKILL)
    scheduler.forget()
    node.start(fabric_address="127.0.0.1")
    (adopted,) = scheduler.wait("hello", lambda b: b["shards"])["shards"]
    assert (adopted["id"], adopted["state"], adopted["pid"], adopted["role"]) == (
        "r-1.w0", "ready", shard["pid"], "rpc-worker")  # fmt: skip

    scheduler.send(NODE, "stop_shard", {"id": "r-1.w0"})
    scheduler.wait_shard("r-1.w0", "stopped")
    eventually(lambda: not Path(f"/proc/{shard['pid']}").exists()
               or Path(f"/proc/{shard['pid']}/stat").read_text().split(")")[1].split()[0]
               == "Z", what="rpc-server to be gone")  # fmt: skip
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", shard["port"])) != 0


def test_a_worker_on_a_node_without_a_private_fabric_address_fails_saying_why(scheduler, node):
    node.start(fabric_address="0.0.0.0")
    scheduler.wait("hello")
    scheduler.send(NODE, "start_shard", worker_body("r-2.w0"))
    failed = scheduler.wait_shard("r-2.w0", "failed")
    assert "must not listen on every interface" in failed["reason"]
    assert not (node.state / "shards" / "r-2.w0.json").exists()


def test_a_vllm_rank_is_read_from_its_start_and_one_that_cannot_join_is_refused():
    assert rank_of({"id": "r-1"}) is None  # not a rank: alone, or an rpc-server worker
    assert rank_of({"gang": {"nnodes": 2, "rank": 0}}) == Rank(2, 0, "")
    assert rank_of({"gang": {"nnodes": 2, "rank": 1, "master": "10.0.0.1:8102"}}).master == (
        "10.0.0.1:8102")  # fmt: skip
    for gang, words in [({"nnodes": 1}, "nnodes >= 2"), ({"nnodes": 2, "rank": 2}, "rank <"),
                        ({"nnodes": 2, "rank": 1}, "leader's ADDR:PORT"),
                        ({"rank": 1}, "not nnodes")]:  # fmt: skip
        with pytest.raises(AgentError, match=words):
            rank_of({"gang": gang})
