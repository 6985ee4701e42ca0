"""llama.cpp: llama.cpp's own `llama-server`, and its `rpc-server` for the workers of a
replica across nodes.

Installed as a build: the agent (tools/agentd/engines.py) compiles llama.cpp with cmake
from the source vendored in the pinned `llama-cpp-python` sdist, with llmgw's patches
(tools/agentd/patches/), the way scripts/build-llama-server does, and takes a finished
build from its cache (~/.cache/llmgw/engines/llama.cpp-VERSION/) when there is one.

A build uses CUDA (GGML_CUDA) on a node that has GPUs and the CUDA toolkit (nvcc), and
the CPU alone elsewhere; a CUDA build is cached apart (llama.cpp-VERSION-cuda/), so the
CPU build that scripts/build-llama-server leaves for tests and CI is never taken for it.
The CPU build cannot use the GPUs a profile asks for: placement refuses such a profile on
a node whose llama.cpp is built for the CPU only (the agent reports what each build can
use). Any llama.cpp *can* use a GPU, so the catalog takes a model with profile.gpus.

Its load signal is `GET /slots`: one entry per slot, busy while it answers a request.
"""

import json
from pathlib import Path

from llmgw.engines import (
    ALONE,
    BUILD,
    CHAT,
    COMPLETIONS,
    CPU,
    CUDA,
    EMBEDDINGS,
    LEADER,
    MESSAGES,
    RERANK,
    RESPONSES,
    WORKER,
    Command,
    Engine,
    Host,
    Install,
    Launch,
    Load,
    TokenCounters,
)  # fmt: skip
from llmgw.errors import EngineError

NAME = "llama.cpp"
VERSION = "0.3.36"  # llama-cpp-python's, whose vendored llama.cpp is built


def cuda(host: Host) -> bool:
    """Whether a build on `host` uses CUDA: it needs the toolkit to be built, and GPUs to
    be of use (a CUDA llama-server does not even start without the driver's libcuda)."""
    return bool(host.gpus and host.nvcc)


def cache_name(version: str, with_cuda: bool) -> str:
    """The build's directory in the engine cache: the CPU build where
    scripts/build-llama-server puts it, a CUDA build beside it."""
    return f"{NAME}-{version}" + ("-cuda" if with_cuda else "")


def install(version: str, host: Host) -> Install:
    """A build, CUDA's where the node has GPUs and the toolkit; llama-server is placed last."""
    with_cuda = cuda(host)
    return Install(
        BUILD,
        marks=("bin/llama-server",),
        note=f"llama-server and rpc-server built from llama-cpp-python=={version}'s"
        f" vendored llama.cpp{' with CUDA' if with_cuda else ''}, cached under"
        " ~/.cache/llmgw/engines",
        cache=cache_name(version, with_cuda),
        accelerators=(CPU, CUDA) if with_cuda else (CPU,),
    )


def cmake_configure(src: str, build: str, nvcc: str = "") -> list[str]:
    """The cmake command that configures a build of llama.cpp's source `src` in `build`:
    with CUDA, compiled by `nvcc` (the toolkit's compiler), or for the CPU alone where
    `nvcc` is "". The agent and scripts/build-llama-server (CPU) both run this one."""
    # LLAMA_USE_PREBUILT_UI would download the web UI from the internet. GGML_NATIVE off:
    # a build is cached and may be copied to another machine of the same kind; with CUDA
    # that also makes llama.cpp compile for its usual set of GPU architectures.
    argv = [
        "cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=OFF", "-DGGML_RPC=ON",
    ]  # fmt: skip
    if nvcc:
        argv += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    return argv


def server_command(binary: Path, launch: Launch) -> list[str]:
    """llama-server for one replica, or the leader of one across nodes (`launch.rpc`)."""
    # llama-server splits -c across its -np slots; a profile's context is per slot.
    # --swa-full: a model with sliding-window attention (Gemma 2 and 3, ...) keeps every
    # layer's whole cache, so a cached prompt can be cut back to any prefix. Without it
    # llama-server can restore only checkpoints, and a conversation whose system prompt
    # the engine evaluated before, in a slot another conversation took since, gets it
    # evaluated again (bench/ROUTING-RUNS.md, runs 34-38). gguf.estimate() reserves this
    # memory already; models without sliding windows ignore the flag.
    named = ["--alias", launch.served_name] if launch.served_name else []
    # GPUs given (a CUDA build; CUDA_VISIBLE_DEVICES names them): every layer on them. A
    # leader's own -ngl puts its layers on its workers.
    gpu = ["-ngl", "999"] if launch.gpus and not launch.rpc else []
    return [
        str(binary), "-m", launch.model_path, "--host", launch.host,
        "--port", str(launch.port), "--api-key-file", launch.key_file,
        "-c", str(launch.context * launch.parallel), "-np", str(launch.parallel),
        "--swa-full", "--metrics", *named, *gpu,
        *(leader_args(list(launch.rpc), list(launch.tensor_split)) if launch.rpc else ()),
        *launch.args,
    ]  # fmt: skip


def leader_args(workers: list[str], tensor_split: list[float]) -> list[str]:
    """What the leader's llama-server adds: its workers, each one's part, every layer on
    them (-ngl 99: the RPC devices take the layers; on a CPU node nothing else would)."""
    out = ["--rpc", ",".join(workers), "-ngl", "99"]
    if tensor_split:
        out += ["--tensor-split", ",".join(f"{p:g}" for p in tensor_split)]
    return out


def rpc_command(binary, host: str, port: int, threads: int) -> list[str]:
    """rpc-server on `host:port`. `-t`: without it rpc-server computes on a fraction of the
    node's cores, and a split replica ran at 0.66× the tokens/s it has with them."""
    return [str(binary), "-H", host, "-p", str(port), "-t", str(max(1, threads))]


def command(role: str, engine_dir: Path, launch: Launch) -> Command:
    if role == WORKER:
        return Command(rpc_command(engine_dir / "bin" / "rpc-server", launch.host,
                                   launch.port, launch.threads))  # fmt: skip
    if role not in (ALONE, LEADER):
        raise EngineError(f"{NAME} has no shard role {role!r}")
    return Command(server_command(engine_dir / "bin" / "llama-server", launch))


def read_slots(body: bytes) -> Load | None:
    """llama-server's /slots: every slot, busy while `is_processing` (older versions:
    `state` 1), and its `n_ctx`; None for anything else."""
    data = json.loads(body)
    if not isinstance(data, list) or not data:
        return None
    busy = ctx = 0
    for slot in data:
        if not isinstance(slot, dict):
            return None
        if slot.get("is_processing") is True or slot.get("state") == 1:
            busy += 1
        n_ctx = slot.get("n_ctx")
        if isinstance(n_ctx, int) and not isinstance(n_ctx, bool):
            ctx += n_ctx
    return Load(running=busy, slots=len(data), ctx=max(0, ctx))


ENGINE = Engine(
    name=NAME,
    default_version=VERSION,
    install=install,
    command=command,
    load_path="/slots",
    read_load=read_slots,
    # llama-server serves Messages and Responses itself.
    apis=frozenset((CHAT, COMPLETIONS, EMBEDDINGS, RERANK, RESPONSES, MESSAGES)),
    # llama-server counts the prompt tokens it evaluated apart from those it reused.
    counters=TokenCounters(
        prompt=("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total"),
        cached="llamacpp:prompt_tokens_cached_total",
        generated="llamacpp:tokens_predicted_total",
    ),
    needs_gpus=False,
    # CUDA where its node has the toolkit (install); the CPU build cannot use a GPU.
    accelerators=frozenset((CPU, CUDA)),
    spans_nodes=True,
    prompt_progress=True,
    worker_binary="bin/rpc-server",
)
