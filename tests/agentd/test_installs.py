"""Engine installs on a node: llama.cpp built with CUDA only where the toolkit and GPUs
are, what each build can use reported, and a failed install retried with backoff until it
succeeds — with no agent restart (the last test runs the real llmgw-agentd)."""

import os
import random
import subprocess
import sys

import pytest

from llmgw import engines
from llmgw.config import AgentConfig
from llmgw.engines import CPU, CUDA, Host, llamacpp
from llmgw_agentd.engines import FAILED, INSTALLED, INSTALLING, Installer, patch_stamp
from llmgw_agentd.errors import EngineError
from llmgw_agentd.resources import find_nvcc
from llmgw_agentd.retries import Retries
from tests.helpers import ROOT, eventually

VERSION = "0.3.36"
NVCC = "/usr/local/cuda-12.4/bin/nvcc"


class Highest(random.Random):
    """Jitter at its top: every wait is the whole backoff."""

    def uniform(self, a, b):
        return b


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the cmake command line ----------------------------------------------------------------


def test_llama_cpp_is_configured_with_cuda_when_the_toolkit_is_there_and_for_the_cpu_if_not():
    cpu = llamacpp.cmake_configure("/src", "/build")
    cuda = llamacpp.cmake_configure("/src", "/build", nvcc=NVCC)
    assert cpu[:5] == ["cmake", "-S", "/src", "-B", "/build"]
    assert "-DGGML_RPC=ON" in cpu and "-DGGML_NATIVE=OFF" in cpu
    assert not any("CUDA" in arg for arg in cpu)
    assert cuda == [*cpu, "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={NVCC}"]


def test_a_cuda_build_needs_gpus_and_the_toolkit_and_is_cached_apart_from_the_cpu_build():
    cuda = llamacpp.install(VERSION, Host(gpus=True, nvcc=NVCC))
    assert cuda.accelerators == (CPU, CUDA) and cuda.cache == f"llama.cpp-{VERSION}-cuda"
    for host in (Host(), Host(gpus=True), Host(nvcc=NVCC)):  # no toolkit, or nothing to use
        plan = llamacpp.install(VERSION, host)
        assert plan.accelerators == (CPU,) and plan.cache == f"llama.cpp-{VERSION}"


def test_the_build_script_configures_the_cpu_build_with_the_agents_command():
    script = str(ROOT / "scripts" / "build-llama-server")
    listed = subprocess.run([script, "--print-configure", "/s rc", "/b"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert listed.stdout.splitlines() == llamacpp.cmake_configure("/s rc", "/b")


def test_the_build_script_runs_that_command(tmp_path):
    # A fake pip (an sdist with an empty source tree) and a fake cmake that records its
    # arguments and fails: the script stops at its configure step. Version 0.0.1 has no
    # patches to apply to the empty tree.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f"""#!{sys.executable}
import os, sys, tarfile, tempfile
if sys.argv[1:3] != ["-m", "pip"]:
    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
out = sys.argv[sys.argv.index("-d") + 1]
with tempfile.TemporaryDirectory() as d:
    os.makedirs(d + "/llama_cpp_python-0.0.1/vendor/llama.cpp")
    with tarfile.open(out + "/llama_cpp_python-0.0.1.tar.gz", "w:gz") as tar:
        tar.add(d + "/llama_cpp_python-0.0.1", "llama_cpp_python-0.0.1")
""")
    cmake = bin_dir / "cmake"
    cmake.write_text(f"#!/bin/sh\nprintf '%s\\n' cmake \"$@\" > {tmp_path}/cmake.argv\nexit 1\n")
    for f in (python, cmake):
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": str(python),
        "LLMGW_CACHE": str(tmp_path / "cache"),
        "LLAMA_CPP_PYTHON_VERSION": "0.0.1",
    }
    done = subprocess.run([str(ROOT / "scripts" / "build-llama-server")], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1, done.stderr
    work = tmp_path / "cache" / "build" / "llama.cpp-0.0.1"
    src = work / "llama_cpp_python-0.0.1" / "vendor" / "llama.cpp"
    argv = (tmp_path / "cmake.argv").read_text().splitlines()
    assert argv == llamacpp.cmake_configure(str(src), str(work / "build"))


def test_the_agent_configures_its_build_with_cuda_where_the_node_has_gpus_and_nvcc(
    tmp_path, monkeypatch
):
    steps = []

    def run(self, argv, log_file, what, engine_id):
        steps.append((what, argv))
        if what == "configure":
            raise EngineError(f"{engine_id}: stopped before compiling")

    monkeypatch.setattr(Installer, "_run", run)
    # No sdist to unpack: its source is not needed to see the configure step.
    monkeypatch.setattr("tarfile.open", lambda *a: _NoTar())
    cache = tmp_path / "cache"
    (cache / f"llama.cpp-{VERSION}" / "bin").mkdir(parents=True)  # a CPU build: not taken
    (cache / f"llama.cpp-{VERSION}" / "bin" / "llama-server").write_text("cpu")
    (cache / f"llama.cpp-{VERSION}" / "PATCHES").write_text(patch_stamp(VERSION))
    installer = Installer(AgentConfig(engine_cache=str(cache)), tmp_path / "state",
                          lambda: True, lambda *a: None, nvcc=lambda: NVCC)  # fmt: skip
    with pytest.raises(EngineError, match="stopped before compiling"):
        installer.ensure("llama.cpp", VERSION)
    configure = dict(steps)["configure"]
    assert configure[-2:] == ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={NVCC}"]


class _NoTar:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def extractall(self, *a, **kw):
        pass


def test_nvcc_is_found_by_cuda_home_or_path_and_absent_otherwise(tmp_path):
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert find_nvcc({"CUDA_HOME": str(tmp_path / "cuda")}, roots=()) == str(nvcc)
    assert find_nvcc({"PATH": str(nvcc.parent)}, roots=()) == str(nvcc)
    assert find_nvcc({}, roots=(str(tmp_path / "cuda"),)) == str(nvcc)
    assert find_nvcc({"CUDA_HOME": str(tmp_path / "nowhere"), "PATH": ""}, roots=()) == ""


# -- what each build can use -----------------------------------------------------------------


def cpu_build_in_cache(tmp_path):
    cache = tmp_path / "cache"
    built = cache / f"llama.cpp-{VERSION}" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    (built.parent.parent / "PATCHES").write_text(patch_stamp(VERSION))
    return cache


def test_the_agent_reports_what_its_build_can_use_and_what_an_install_would(tmp_path):
    cache = cpu_build_in_cache(tmp_path)
    installer = Installer(AgentConfig(engine_cache=str(cache)), tmp_path / "state",
                          lambda: False, lambda *a: None, nvcc=lambda: "")  # fmt: skip
    assert installer.installable()["llama.cpp"] == {"accelerators": [CPU]}
    installer.ensure("llama.cpp", VERSION)
    engine_dir = tmp_path / "state" / "engines" / f"llama.cpp-{VERSION}"
    assert (engine_dir / "ACCELERATORS").read_text() == "cpu\n"
    assert installer.report()[f"llama.cpp-{VERSION}"] == {
        "state": INSTALLED, "reason": "", "accelerators": [CPU]}  # fmt: skip
    # The toolkit arrives later: an install would use CUDA, the build there still cannot.
    installer.nvcc, installer.has_gpu = (lambda: NVCC), (lambda: True)
    assert installer.installable()["llama.cpp"] == {"accelerators": [CPU, CUDA]}
    assert installer.report()[f"llama.cpp-{VERSION}"]["accelerators"] == [CPU]
    # A build from before builds said: for the CPU, as every one then was.
    (engine_dir / "ACCELERATORS").unlink()
    assert installer.report()[f"llama.cpp-{VERSION}"]["accelerators"] == [CPU]


# -- retries -------------------------------------------------------------------------------


def test_failed_installs_wait_twice_as_long_each_time_up_to_the_bound():
    retries = Retries(30.0, 1800.0, Highest())
    waits = [retries.failed("vllm", "1", 0.0) for _ in range(9)]
    assert waits == [30, 60, 120, 240, 480, 960, 1800, 1800, 1800]
    jittered = Retries(30.0, 1800.0, random.Random(7))
    waits = [jittered.failed("vllm", "1", 0.0) for _ in range(8)]
    bounds = [30, 60, 120, 240, 480, 960, 1800, 1800]
    assert all(b / 2 <= w <= b for w, b in zip(waits, bounds, strict=True))
    assert len(set(waits)) == len(waits)  # not in lockstep with another node


def test_a_retry_is_due_once_its_wait_is_over_and_taken_once():
    retries = Retries(30.0, 1800.0, Highest())
    retries.failed("vllm", "1", 100.0)
    assert retries.due(129.0) == []
    assert retries.info("vllm-1", 100.0) == {"attempts": 1, "retry_in_s": 30.0}
    (due,) = retries.due(130.0)
    assert (due.name, due.version) == ("vllm", "1")
    assert retries.due(500.0) == []  # running: not started twice
    assert retries.info("vllm-1", 500.0) == {"attempts": 1, "retry_in_s": 0.0}
    retries.failed("vllm", "1", 140.0)
    assert retries.info("vllm-1", 140.0) == {"attempts": 2, "retry_in_s": 60.0}
    retries.succeeded("vllm-1")
    assert retries.info("vllm-1", 140.0) == {} and retries.due(1e9) == []


def test_a_failed_install_is_retried_with_backoff_and_installed_once_its_source_is_there(
    tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    clock = Clock()
    seen = []

    def run(self, argv, log_file, what, engine_id):
        raise EngineError(f"{engine_id}: {what} exited 1:\nno network")

    monkeypatch.setattr(Installer, "_run", run)
    installer = Installer(AgentConfig(engine_cache=str(cache), install_backoff_base_s=30,
                                      install_backoff_max_s=600),
                          tmp_path / "state", lambda: False, lambda *a: seen.append(a[1:]),
                          nvcc=lambda: "", clock=clock, rng=Highest())  # fmt: skip
    engine_id = f"llama.cpp-{VERSION}"
    with pytest.raises(EngineError, match="no network"):
        installer.ensure("llama.cpp", VERSION)
    assert installer.report()[engine_id] == {
        "state": FAILED, "reason": f"{engine_id}: download exited 1:\nno network",
        "accelerators": [CPU], "attempts": 1, "retry_in_s": 30.0}  # fmt: skip

    clock.now += 29
    installer.retry_due()  # not yet
    assert installer.report()[engine_id]["retry_in_s"] == 1.0
    clock.now += 1
    installer.retry_due()  # tried again, fails again: twice the wait, still "failed"
    eventually(lambda: installer.report()[engine_id].get("attempts") == 2, 10, what="retry")
    assert installer.report()[engine_id]["retry_in_s"] == 60.0
    assert [s for s, _ in seen] == [INSTALLING, FAILED]  # never "installing" again

    cpu_build_in_cache(tmp_path)  # the source appears
    clock.now += 60
    installer.retry_due()
    eventually(lambda: installer.report()[engine_id]["state"] == INSTALLED, 10, what="install")
    assert installer.report()[engine_id] == {
        "state": INSTALLED, "reason": "", "accelerators": [CPU]}  # fmt: skip
    assert [s for s, _ in seen] == [INSTALLING, FAILED, INSTALLED]
    clock.now += 1e6
    installer.retry_due()
    assert installer.entry(engine_id) == {"state": INSTALLED, "reason": "",
                                          "accelerators": [CPU]}  # fmt: skip


def test_an_engine_this_node_can_never_run_is_not_retried(tmp_path):
    import dataclasses

    from tests import third_engine

    clock = Clock()
    venv = engines.Install(engines.VENV, ("third==1",), marks=(".installed",))
    engines.register(dataclasses.replace(third_engine.ENGINE, install=lambda v, h: venv))
    installer = Installer(AgentConfig(), tmp_path, lambda: False, lambda *a: None,
                          clock=clock)  # fmt: skip
    try:
        with pytest.raises(EngineError, match="needs a GPU"):
            installer.ensure("third", "1")
        assert "retry_in_s" not in installer.report()["third-1"]
        clock.now += 1e6
        installer.retry_due()
        assert installer.report()["third-1"]["state"] == FAILED
    finally:
        third_engine.unregister()


# -- the real agent --------------------------------------------------------------------------


def test_the_agent_retries_a_failed_install_and_reports_it_installed_without_a_restart(
    node, scheduler, tmp_path, monkeypatch
):
    # No package index: pip cannot fetch llama.cpp's source, so the first install fails
    # at once, every time, until a finished build appears in the engine cache.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    cache = tmp_path / "cache"
    proc = node.start(engine_cache=str(cache), install_backoff_base_s=1.0,
                      install_backoff_max_s=2.0, gpus=0)  # fmt: skip
    hello = scheduler.wait("hello", timeout=20)
    assert hello["installable"]["llama.cpp"] == {"accelerators": [CPU]}
    engine_id = f"llama.cpp-{VERSION}"
    scheduler.send(node.name, "install_engine", {"engine": "llama.cpp", "version": VERSION})

    failed = scheduler.wait("install_status", lambda b: b["state"] == FAILED, timeout=60)
    assert failed["engine"] == engine_id and "download exited" in failed["reason"]
    assert failed["attempts"] == 1 and 0 < failed["retry_in_s"] <= 1.0
    beat = scheduler.wait("heartbeat", lambda b: b["engines"].get(engine_id, {}).get(
        "attempts", 0) >= 2, timeout=60)  # fmt: skip
    assert beat["engines"][engine_id]["state"] == FAILED  # retried, failed again

    cpu_build_in_cache(tmp_path)
    scheduler.wait("install_status", lambda b: b["state"] == INSTALLED, timeout=60)
    beat = scheduler.wait("heartbeat", lambda b: b["engines"].get(engine_id, {}).get(
        "state") == INSTALLED, timeout=20)  # fmt: skip
    assert beat["engines"][engine_id] == {"state": INSTALLED, "reason": "",
                                          "accelerators": [CPU]}  # fmt: skip
    assert proc.p.poll() is None and len(node.procs) == 1  # the same agent, never restarted
    assert "install_retry" in proc.log()
