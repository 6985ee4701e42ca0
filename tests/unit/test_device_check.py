"""scripts/device-check cannot run its checks here (no GPU): its refusal, its dry run and
its pure parts (nvidia-smi's UUIDs, /proc's environ and process groups, the switch's
arithmetic) can."""

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time

import pytest

from llmgw.engines import vllm
from tests.helpers import ROOT, eventually

SCRIPT = ROOT / "scripts" / "device-check"
UUID = "GPU-6d2f1a9e-0c3b-4f5e-9a7d-1b2c3d4e5f60"


def load():
    loader = importlib.machinery.SourceFileLoader("device_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("device_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


dc = load()


def run(*args: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env={"PATH": path, "HOME": "/nonexistent"}, timeout=120)  # fmt: skip


def fake_nvidia_smi(bin_dir, output: str) -> str:
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\n")
    smi.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2_at_once(tmp_path):
    started = time.monotonic()
    result = run(path=str(tmp_path))  # no nvidia-smi on this PATH
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "device-check: FAIL no NVIDIA GPU here (nvidia-smi is missing or lists none)"
    ]
    assert result.stdout == ""
    assert time.monotonic() - started < 30


def test_an_nvidia_smi_that_finds_no_gpu_is_no_gpu_too(tmp_path):
    result = run(path=fake_nvidia_smi(tmp_path, "No devices were found\n"))
    assert result.returncode == 2
    assert "no NVIDIA GPU here" in result.stderr


def test_with_a_gpu_but_no_model_directory_it_fails_with_1_and_names_the_fix(tmp_path):
    result = run(path=fake_nvidia_smi(tmp_path, f"{UUID}\n"))
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "is not a Hugging Face model directory" in line and "make vllm" in line


def test_a_dry_run_writes_a_config_that_checks_for_vllm_on_one_gpu_with_sleep_mode(tmp_path):
    result = run("--dry-run", "--vllm-version", "0.31.0", path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "checks" in out.splitlines()[0]
    assert 'engine = "vllm"' in out and 'engine_version = "0.31.0"' in out
    assert "gpus = 1" in out
    assert '"--enable-sleep-mode"' in out
    assert 'fabric_address = "127.0.0.1"' in out


def test_by_default_it_runs_the_vllm_version_its_engine_module_pins(tmp_path):
    """Not a version of its own that drifts from what the agent installs."""
    result = run("--dry-run", path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f'engine_version = "{vllm.VERSION}"' in result.stdout
    # vLLM reads no GGUF: the model is a Hugging Face directory (make vllm's SmolLM2).
    assert 'source = "/nonexistent/.cache/llmgw/models/smollm2-135m-instruct-hf"' in result.stdout


def test_every_step_gets_its_whole_deadline_inside_a_budget_under_nine_minutes():
    assert sum(dc.STEP_S.values()) <= dc.BUDGET_S
    assert dc.AFTER_SERVE_S + dc.STEP_S["serve"] + dc.STEP_S["agent"] <= dc.BUDGET_S
    assert dc.BUDGET_S + 15 < 9 * 60  # the alarm's backstop, too


def test_uuids_are_read_from_nvidia_smis_csv_lines():
    out = f"{UUID}\nGPU-00000000-1111-2222-3333-444444444444\n\n"
    assert dc.parse_uuids(out) == [UUID, "GPU-00000000-1111-2222-3333-444444444444"]
    assert dc.parse_uuids("No devices were found\n") == []
    assert dc.parse_uuids("") == []


def test_an_environ_is_split_on_nuls_and_keeps_equals_signs_in_values():
    raw = f"PATH=/bin\0CUDA_VISIBLE_DEVICES={UUID}\0OPTS=a=b\0NOEQUALS\0\0".encode()
    env = dc.parse_environ(raw)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": UUID, "OPTS": "a=b"}


def test_a_cmdline_is_its_nul_terminated_arguments():
    assert dc.parse_cmdline(b"python\0-m\0vllm.x\0--port\0\0") == ["python", "-m", "vllm.x",
                                                                  "--port", ""]  # fmt: skip
    assert dc.parse_cmdline(b"") == []


def test_the_process_group_is_read_past_a_name_with_spaces_and_parentheses():
    stat = "4242 (VLLM::E) 7 (core)) S 1 4200 4200 0 -1 4194560 0"
    assert dc.process_group(stat) == 4200


def test_the_gpu_row_is_found_by_uuid_and_none_when_absent():
    rows = [{"node": "n", "index": 0, "uuid": "GPU-other"}, {"node": "n", "index": 1, "uuid": UUID}]
    assert dc.gpu_row(rows, UUID)["index"] == 1
    assert dc.gpu_row(rows, "GPU-missing") is None


def test_the_switch_compares_wake_and_first_token_with_a_start_and_first_token():
    s = dc.Switch(sleep=0.5, wake=0.3, wake_first_token=0.2, stop=2.0, start_to_health=39.0,
                  restart_first_token=1.0)  # fmt: skip
    assert s.warm == pytest.approx(0.5)
    assert s.cold == pytest.approx(40.0)
    line = s.line()
    assert "sleep(level 1) 0.50s" in line and "wake 0.30s" in line
    assert "0.50s warm vs 40.00s cold (80.0x)" in line
    assert "sleep+wake 1.00s vs stop+start 42.00s" in line


def test_a_step_deadline_never_passes_the_overall_budget():
    b = dc.Budget(100.0, now=1000.0)
    assert b.step(30.0, now=1000.0) == 1030.0
    assert b.step(30.0, now=1090.0) == 1100.0
    assert b.left(1040.0) == 60.0


def test_an_engine_is_read_from_proc_its_key_gpu_command_and_directory(tmp_path):
    env = {"PATH": os.environ["PATH"], "VLLM_API_KEY": "k1", "CUDA_VISIBLE_DEVICES": UUID}
    p = subprocess.Popen(["sleep", "30"], env=env, cwd=tmp_path)
    try:
        # Until it has exec'd, /proc shows the forking parent's environment.
        e = eventually(lambda: (e := dc.engine_of(p.pid, "http://127.0.0.1:1")).argv[0] == "sleep"
                       and e, what="sleep to exec")  # fmt: skip
        assert e.env["CUDA_VISIBLE_DEVICES"] == UUID
        assert e.key == "k1" and e.headers() == {"Authorization": "Bearer k1"}
        assert e.argv == ["sleep", "30"]
        assert e.cwd == str(tmp_path)
    finally:
        p.kill()
        p.wait()


def test_stopping_an_engine_ends_its_whole_process_group():
    p = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60; wait"], start_new_session=True)
    try:
        eventually(lambda: dc.group_alive(p.pid), what="the group to start")
        dc.stop_group(p.pid, time.monotonic() + 10)
        assert not dc.group_alive(p.pid)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
