"""alerts/: the rules are valid, every alert is tested both ways, and every alert says
what to do.

PyYAML is not a dependency, so the files are read by their lines: one `- alert: NAME`
per rule, and in the tests one `exp_alerts:` after each `alertname:`. promtool's own
rule count guards that reading (see the first test).
"""

import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import ROOT

ALERTS = ROOT / "alerts"
RULES = ALERTS / "llmgw.rules.yml"
TESTS = ALERTS / "llmgw.tests.yml"


def promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: apt-get install prometheus")
        pytest.skip("promtool is missing (apt-get install prometheus)")
    return subprocess.run(
        ["promtool", *args], cwd=ALERTS, capture_output=True, text=True, timeout=120
    )


def rules() -> dict[str, str]:
    """Each alert's name and the text of its rule, up to the next rule or group."""
    blocks = re.split(r"^\s*- (?=alert:|name:)", RULES.read_text(), flags=re.M)
    found = {}
    for block in blocks:
        named = re.match(r"alert: (\w+)\s*$", block, re.M)
        if named:
            assert named.group(1) not in found, f"{named.group(1)} is defined twice"
            found[named.group(1)] = block
    return found


def test_promtool_accepts_the_rules_and_counts_every_one_we_read():
    result = promtool("check", "rules", RULES.name)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    counted = re.search(r"SUCCESS: (\d+) rules found", out)
    assert counted and int(counted.group(1)) == len(rules()), out


def test_the_promtool_unit_tests_pass():
    result = promtool("test", "rules", TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", sorted(rules()))
def test_every_alert_has_a_severity_a_summary_and_a_runbook(alert):
    rule = rules()[alert]
    assert re.search(r"^\s+severity: (page|ticket)\s*$", rule, re.M), f"{alert}: severity"
    summary = re.search(r'^\s+summary: "(.+)"\s*$', rule, re.M)
    assert summary and "{{" in summary.group(1), f"{alert}: summary with a label in it"
    runbook = re.search(r'^\s+runbook: "(.+)"\s*$', rule, re.M)
    assert runbook and "`llmgw" in runbook.group(1), f"{alert}: runbook naming a command"


def test_every_alert_is_tested_firing_and_quiet():
    firing, quiet = set(), set()
    alertname = None
    for line in TESTS.read_text().splitlines():
        if m := re.match(r"\s+alertname: (\w+)\s*$", line):
            alertname = m.group(1)
        elif m := re.match(r"\s+exp_alerts:(.*)$", line):
            assert alertname, f"exp_alerts without an alertname: {line!r}"
            (quiet if m.group(1).strip() == "[]" else firing).add(alertname)
            alertname = None
    assert set(rules()) - firing == set(), "no case expects these firing"
    assert set(rules()) - quiet == set(), "no case expects these quiet"
    assert (firing | quiet) - set(rules()) == set(), "tests name alerts that do not exist"


def test_every_alert_is_in_the_metrics_page():
    alerts = (ROOT / "docs" / "metrics.md").read_text().split("## Alerts", 1)
    assert len(alerts) == 2, "docs/metrics.md has no ## Alerts section"
    documented = set(re.findall(r"^\| `(\w+)` \|", alerts[1], re.M))
    assert documented == set(rules())
