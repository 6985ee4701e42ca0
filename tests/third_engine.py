"""A third engine, as one module: what adding one to llmgw takes (lib/llmgw/engines/).

It runs tests/fake_engine.py, needs a GPU (so placement has something to ask), serves
chat and completions only (so the router translates Messages for it), reads its load
from the fake engine's `GET /load` in a shape of its own, and counts tokens under names
of its own. `register()` makes it known to every tool in this process, as a line in
`llmgw.engines.BUILTIN` would for one shipped with llmgw.
"""

import json
import sys
from pathlib import Path

from llmgw import engines
from llmgw.engines import (
    ALONE,
    CHAT,
    COMPLETIONS,
    CUDA,
    PROVIDED,
    Command,
    Engine,
    Host,
    Install,
    Launch,
)
from llmgw.errors import EngineError

NAME = "third"
FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


def install(version: str, host: Host) -> Install:
    return Install(PROVIDED, note="the fake engine beside this module", accelerators=(CUDA,))


def command(role: str, engine_dir: Path, launch: Launch) -> Command:
    if role != ALONE:
        raise EngineError(f"{NAME} runs on one node only")
    return Command([sys.executable, str(FAKE_ENGINE), "--host", launch.host,
                    "--port", str(launch.port), "--key-file", launch.key_file,
                    "--alias", launch.served_name, *launch.args])  # fmt: skip


def read_load(body: bytes) -> engines.Load | None:
    data = json.loads(body)
    if not isinstance(data, dict) or not isinstance(data.get("running"), int):
        return None
    return engines.Load(running=data["running"], waiting=int(data.get("waiting", 0)))


ENGINE = Engine(
    name=NAME,
    default_version="1",
    install=install,
    command=command,
    load_path="/load",
    read_load=read_load,
    apis=frozenset((CHAT, COMPLETIONS)),
    counters=engines.TokenCounters(prompt=("third:prompt_total",), generated="third:out_total"),
    drain=engines.Drain(settle_s=0.1, poll_s=0.05),
    needs_gpus=True,
    accelerators=frozenset((CUDA,)),
)


def register() -> Engine:
    return engines.register(ENGINE)


def unregister() -> None:
    engines.unregister(NAME)
