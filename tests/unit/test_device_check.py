"""scripts/device-check cannot run here (no GPU): its dry run and its refusal can."""

import subprocess
import sys

from llmgw.engines import vllm
from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "device-check"


def run(*args: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env={"PATH": path, "HOME": "/nonexistent"}, timeout=120)  # fmt: skip


def test_without_a_gpu_it_fails_at_once_with_one_line(tmp_path):
    result = run(path=str(tmp_path))  # no nvidia-smi on this PATH
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "device-check: FAIL no NVIDIA GPU here (nvidia-smi is missing or lists none)"
    ]


def test_a_dry_run_writes_a_config_that_checks_for_vllm_on_one_gpu(tmp_path):
    result = run("--dry-run", "--vllm-version", "0.31.0", path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "checks" in out.splitlines()[0]
    assert 'engine = "vllm"' in out and 'engine_version = "0.31.0"' in out
    assert "gpus = 1" in out
    assert 'fabric_address = "127.0.0.1"' in out


def test_by_default_it_runs_the_vllm_version_its_engine_module_pins(tmp_path):
    """Not a version of its own that drifts from what the agent installs."""
    result = run("--dry-run", path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f'engine_version = "{vllm.VERSION}"' in result.stdout
    # vLLM reads no GGUF: the model is a Hugging Face directory (make vllm's SmolLM2).
    assert 'source = "/nonexistent/.cache/llmgw/models/smollm2-135m-instruct-hf"' in result.stdout
