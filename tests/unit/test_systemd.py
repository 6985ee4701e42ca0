import re
import shutil
import subprocess

import pytest

from tests.helpers import BIN, ROOT, unit_service


@pytest.mark.parametrize("unit", sorted(p.name for p in (ROOT / "systemd").iterdir()))
def test_every_unit_passes_systemd_analyze_verify(unit, tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd")
    units = [unit]
    if unit.endswith(".timer"):
        # systemd-analyze passes a timer whose service is missing: check that here, and
        # verify the two together.
        named = re.search(r"^Unit=(\S+)", (ROOT / "systemd" / unit).read_text(), re.M)
        service = named.group(1) if named else unit.removesuffix(".timer") + ".service"
        assert (ROOT / "systemd" / service).exists(), f"{unit} starts {service}: it is missing"
        units.append(service)
    for name in units:
        text = (ROOT / "systemd" / name).read_text()
        # Point ExecStart at this checkout's venv, where the executables really are.
        text = text.replace("/opt/llmgw/venv/bin/", f"{BIN}/")
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / name) for name in units)],
        capture_output=True,
        text=True,
    )
    problems = [
        line
        for line in result.stderr.splitlines()
        if any(name in line for name in units) or "Unknown" in line
    ]
    assert result.returncode == 0 and not problems, result.stderr


# `systemd-analyze security` exposure, 0 (locked down) to 10 (exposed), that each service
# must stay at or below. The agent is allowed more: it starts engines that need the GPUs
# and may JIT, and whatever it has they inherit.
EXPOSURE_TARGETS = {
    "llmgw-router.service": 2.5,
    "llmgw-scheduler.service": 2.5,
    "llmgw-agentd.service": 5.0,
    "llmgw-backup.service": 3.5,
    "llmgw-certmon.service": 3.5,
    "llmgw-certmon-renew.service": 3.5,
    "llmgw-usage-rollup.service": 3.5,
}
SERVICES = sorted(p.name for p in (ROOT / "systemd").glob("*.service"))


def exposure(unit: str) -> float:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd")
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(ROOT / "systemd" / unit)],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert found, f"no exposure level in:\n{result.stdout}\n{result.stderr}"
    return float(found.group(1))


directives = unit_service  # one parser of the units, in tests/helpers.py


def test_every_service_has_an_exposure_target():
    assert sorted(EXPOSURE_TARGETS) == SERVICES


@pytest.mark.parametrize("unit", SERVICES)
def test_every_service_is_rated_no_more_exposed_than_its_target(unit):
    score = exposure(unit)
    assert score <= EXPOSURE_TARGETS[unit], f"{unit} is rated {score}"


def test_the_agent_keeps_its_engines_running_and_reaches_the_gpus_only():
    d = directives("llmgw-agentd.service")
    assert d["KillMode"] == ["process"]  # engines outlive an agent restart
    assert "PrivateDevices" not in d and d["DevicePolicy"] == ["closed"]
    assert {"char-nvidia-frontend rw", "char-nvidia-uvm rw"} <= set(d["DeviceAllow"])
    assert "MemoryDenyWriteExecute" not in d  # engines inherit it, and they JIT


@pytest.mark.parametrize("unit", SERVICES)
def test_no_service_removes_the_ipc_objects_its_user_s_engines_share(unit):
    # Every tool runs as llmgw, engines included: RemoveIPC on any unit would delete the
    # engines' POSIX shared memory whenever that unit stops.
    assert directives(unit).get("RemoveIPC", ["false"]) != ["true"]
