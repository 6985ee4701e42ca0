import re
import shutil
import subprocess

import pytest

from tests.helpers import BIN, ROOT


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
