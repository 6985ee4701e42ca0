"""End to end: the llama-server llmgw builds (tools/agentd/patches/) started as the agent
starts it, and what its host-memory prompt cache does for two slots.

Upstream llama-server puts a slot's prompt in its host-memory cache only when another
prompt takes the slot and keeps under half of it, and moves it out into the slot that
loads it: a second slot that needs the same prompt while the first is busy evaluates it
all again, and a conversation whose slot another one sharing its system prompt took
evaluates its own tail again. The patched engine saves a prompt it evaluated mostly from
scratch at once, copies a cached prompt into a slot, and saves a tail another prompt
overwrites, so a system prompt shared by concurrent requests is evaluated once and a
conversation's earlier turns once.
"""

import secrets
from pathlib import Path

import pytest
import requests

from llmgw_agentd.engines import Launch, llama_command
from tests.e2e.test_llama_server import engine_binary, model_file
from tests.helpers import Proc, free_port

pytestmark = pytest.mark.e2e


def rules(team: str, n: int = 40) -> str:
    """A prompt of ~600 tokens that shares nothing with another team's."""
    return " ".join(f"{team} rule {i}: keep the logs of {team} for {i} days." for i in range(n))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache")
    key = secrets.token_urlsafe(16)
    (tmp / "engine.key").write_text(key + "\n")
    port = free_port()
    launch = Launch(model_path=str(model_file()), host="127.0.0.1", port=port,
                    key_file=str(tmp / "engine.key"), context=2048, parallel=2,
                    args=("-t", "1", "--no-jinja", "--chat-template", "gemma"))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc = Proc(llama_command(Path(engine_binary()), launch), tmp / "llama-server.log",
                health=f"{url}/health")  # fmt: skip
    try:
        proc.wait_healthy(timeout=60)
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {key}"
        yield url, session, proc
    finally:
        proc.stop()


def complete(engine, prompt: str, **body) -> dict:
    url, session, _ = engine
    body = {"prompt": prompt, "n_predict": 2, "cache_prompt": True, **body}
    r = session.post(f"{url}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["timings"]


def while_busy(engine, prompt: str, then) -> dict:
    """Send `prompt` streamed, generating until closed; once it has started answering,
    call `then()`, check the first is still generating, and return what `then` did."""
    url, session, _ = engine
    with session.post(f"{url}/completion", stream=True, timeout=120,
                      json={"prompt": prompt, "n_predict": 1000, "ignore_eos": True,
                            "stream": True}) as busy:  # fmt: skip
        assert busy.status_code == 200
        # Held while the test runs: a dropped iterator closes the stream, and the engine
        # would free the slot.
        events = (line for line in busy.iter_lines() if line.startswith(b"data: "))
        assert b'"content"' in next(events)
        out = then()
        assert b'"stop":false' in next(events).replace(b" ", b""), "the first slot was done"
    return out


def mostly_cached(engine, timings: dict) -> None:
    prompt_tokens = timings["cache_n"] + timings["prompt_n"]
    assert timings["cache_n"] >= 0.9 * prompt_tokens, (timings, engine[2].log()[-3000:])


def test_a_cached_prompt_serves_a_second_slot_while_the_first_is_busy(engine):
    alpha, bravo, charlie = rules("alpha"), rules("bravo"), rules("charlie")
    # Fill both slots, then push alpha out of its slot into the host cache.
    assert complete(engine, alpha)["cache_n"] == 0
    complete(engine, bravo)
    complete(engine, charlie)
    # One slot loads alpha from the cache and stays busy; the other needs alpha too.
    second = while_busy(engine, alpha + " First question.",
                        lambda: complete(engine, alpha + " Second question."))  # fmt: skip
    mostly_cached(engine, second)


def test_a_prompt_just_evaluated_serves_a_second_slot_while_the_first_is_busy(engine):
    # Nothing of delta anywhere: the first request evaluates it, and is still answering
    # when the second, which shares it, arrives.
    delta = rules("delta")
    second = while_busy(engine, delta + " First question.",
                        lambda: complete(engine, delta + " Second question."))  # fmt: skip
    mostly_cached(engine, second)
