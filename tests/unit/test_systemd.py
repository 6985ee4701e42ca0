import shutil
import subprocess

import pytest

from tests.helpers import BIN, ROOT


@pytest.mark.parametrize("unit", sorted(p.name for p in (ROOT / "systemd").iterdir()))
def test_every_unit_passes_systemd_analyze_verify(unit, tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd")
    text = (ROOT / "systemd" / unit).read_text()
    # Point ExecStart at this checkout's venv, where the executables really are.
    text = text.replace("/opt/llmgw/venv/bin/", f"{BIN}/")
    (tmp_path / unit).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / unit)], capture_output=True, text=True
    )
    problems = [line for line in result.stderr.splitlines() if unit in line or "Unknown" in line]
    assert result.returncode == 0 and not problems, result.stderr
