"""End to end: the llama-server llmgw builds (tools/agentd/patches/) started as the agent
starts it, and what its host-memory prompt cache does for two slots.

Upstream llama-server moves a cached prompt into the slot that loads it: a second slot
that needs the same prompt while the first is busy evaluates it all again. The patched
engine copies it, so a system prompt shared by concurrent requests is evaluated once.
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


def test_a_cached_prompt_serves_a_second_slot_while_the_first_is_busy(engine):
    alpha, bravo, charlie = rules("alpha"), rules("bravo"), rules("charlie")
    # Fill both slots, then push alpha out of its slot into the host cache.
    assert complete(engine, alpha)["cache_n"] == 0
    complete(engine, bravo)
    complete(engine, charlie)
    url, session, proc = engine
    # One slot loads alpha from the cache and stays busy: streaming, never done on its own.
    with session.post(f"{url}/completion", stream=True, timeout=120,
                      json={"prompt": alpha + " First question.", "n_predict": 1000,
                            "ignore_eos": True, "stream": True}) as busy:  # fmt: skip
        assert busy.status_code == 200
        # Held while the test runs: a dropped iterator closes the stream, and the engine
        # would free the slot.
        events = (line for line in busy.iter_lines() if line.startswith(b"data: "))
        assert b'"content"' in next(events)
        # The other slot needs alpha too, while the first is still generating.
        second = complete(engine, alpha + " Second question.")
        assert b'"stop":false' in next(events).replace(b" ", b""), "the first slot was done"
    prompt_tokens = second["cache_n"] + second["prompt_n"]
    assert second["cache_n"] >= 0.9 * prompt_tokens, (second, proc.log()[-3000:])
