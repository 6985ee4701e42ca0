"""One vLLM replica across two agents with vLLM's own multi-node mode, through the real
scheduler, agents and router: SmolLM2 as a pipeline of two stages, the leader (rank 0,
vLLM's OpenAI server) on one agent and a headless rank on the other, the two meeting at
the leader's fabric address (127.0.0.2 and 127.0.0.3 stand for two nodes' addresses).
It answers a chat; then one rank is killed, and the scheduler ends the whole gang, says
why, and places a new one.

Two vLLM processes (~4 GB together on this machine; the pair takes ~2-4 minutes to be
healthy on two busy cores, as a pipeline runs vLLM's compiled warm-up), once for the
module. Built by `make vllm` like tests/e2e/test_fleet_vllm.py: without the venv or the
model this skips, except in CI, where it fails."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from llmgw.engines import vllm
from tests.e2e.test_fleet_vllm import WEIGHTS, built_or_skip
from tests.helpers import eventually, llmgw
from tests.system.conftest import Cluster

pytestmark = pytest.mark.e2e
MODEL = "smollm2-pp2"
GiB = 1 << 30
NODES = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}


def agent_extra(address: str) -> str:
    return f'fabric_address = "{address}"\nfabric = "lo"\nfabric_interface = "lo"\n'


@pytest.fixture(scope="module")
def gang_fleet(tmp_path_factory):
    built_or_skip()
    tmp = tmp_path_factory.mktemp("vllm-pp2")
    env = {"LLMGW_STORE": f"sqlite://{tmp}/llmgw.db", "LLMGW_CONFIG": ""}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        c = Cluster(tmp)
        # A failed gang waits this long before its replacement: long enough to read the
        # scheduler saying why.
        c.backoff_s = (20.0, 30.0)
        c.start_timeout_s = 480.0
        profile = "context = 2048\nparallel = 2\nkv_cache_gib = 1\nnodes = 2\n"
        c.add_model(MODEL, memory=0, source=str(WEIGHTS), engine="vllm", version=vllm.VERSION,
                    profile=profile)  # fmt: skip
        c.start_scheduler()
        for node, address in NODES.items():
            # Neither could hold the model (~4.25 GiB by its estimate) alone.
            c.start_agent(node, memory=3 * GiB, extra=agent_extra(address))
        key = json.loads(
            llmgw("keys", "create", "--store", "--name", "pp2", "--json", env=env).stdout
        )
        c.start_router(key["secret"])
        c.started = time.monotonic()
        try:
            yield c
        finally:
            c.stop()  # engines too


def chat(c: Cluster, content: str, max_tokens: int = 16) -> requests.Response:
    return requests.post(
        c.router_url + "/v1/chat/completions",
        json={"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
              "messages": [{"role": "user", "content": content}]},
        headers={"Authorization": f"Bearer {c.secret}"}, timeout=300,
    )  # fmt: skip


def replicas(c: Cluster) -> list[dict]:
    return [r for r in c.admin("/v1/replicas") if r["model"] == MODEL]


def argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").partition("=")[::2] for p in pairs if b"=" in p)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def pid_of(c: Cluster, shard_id: str) -> int | None:
    for node in NODES:
        for s in c.shards(node):
            if s["id"] == shard_id:
                return s["pid"]
    return None


def test_a_pipeline_of_two_vllm_nodes_answers_and_is_replaced_whole_when_a_rank_dies(gang_fleet):
    c = gang_fleet

    def answered():
        r = chat(c, "hi", max_tokens=1)
        assert r.status_code in (200, 503), r.text  # placed, loading: else a failure
        return r.status_code == 200

    eventually(answered, timeout=480, interval=1.0, what="the PP 2 replica to answer")
    print(f"\nPP 2 served {time.monotonic() - c.started:.0f} s after the fleet started")
    r = chat(c, "What is the capital of France?")
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-served-model"] == MODEL
    assert "Paris" in r.json()["choices"][0]["message"]["content"]

    (leader,) = [x for x in replicas(c) if x["state"] == "ready"]
    (worker,) = leader["shards"]
    assert worker["id"] == leader["id"] + ".w1" and worker["state"] == "ready"
    assert {leader["node"], worker["node"]} == set(NODES)
    master = NODES[leader["node"]]
    lpid, wpid = pid_of(c, leader["id"]), pid_of(c, worker["id"])
    largs, wargs = argv(lpid), argv(wpid)
    assert (flag(largs, "--node-rank"), flag(wargs, "--node-rank")) == ("0", "1")
    assert "--headless" in wargs and "--headless" not in largs
    for args in (largs, wargs):
        assert flag(args, "--nnodes") == "2" and flag(args, "--pipeline-parallel-size") == "2"
        assert flag(args, "--master-addr") == master
    assert flag(largs, "--master-port") == flag(wargs, "--master-port")
    assert environ(wpid)["VLLM_HOST_IP"] == NODES[worker["node"]]
    assert environ(lpid)["GLOO_SOCKET_IFNAME"] == "lo"

    # kill -9 the headless rank: its leader would go on answering /health and hang every
    # request, so the scheduler ends the whole replica, says why, and places a new one.
    os.killpg(wpid, signal.SIGKILL)

    def backoff():
        (m,) = [m for m in c.admin("/v1/models") if m["name"] == MODEL]
        return m if m["state"] == "backoff" else None

    m = eventually(backoff, timeout=60, interval=0.2, what="the model to back off")
    assert f"worker {worker['id']}" in m["reason"] and "exited" in m["reason"], m

    def ended() -> bool:
        listed = any(x["id"] == leader["id"] for x in replicas(c))
        return pid_of(c, leader["id"]) is None and not listed

    eventually(ended, timeout=60, what="the leader of the broken gang to be stopped")
    new = eventually(lambda: [x for x in replicas(c) if x["id"] != leader["id"]], timeout=120,
                     interval=0.5, what="a new gang to be placed")  # fmt: skip
    assert new[0]["state"] in ("pending", "starting"), new
