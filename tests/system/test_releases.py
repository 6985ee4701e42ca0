"""`llmgw release publish` and `llmgw release list` against a real scheduler."""

import json

from llmgw import releases
from tests.unit.test_releases import wheel_bytes


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def test_published_wheels_land_in_the_release_directory_and_list_in_version_order(cluster):
    cluster.start_scheduler()
    wheels = {}
    for v in ("0.2.1", "0.2.0", "0.2.1rc1"):
        wheels[v] = cluster.tmp / f"llmgw-{v}-py3-none-any.whl"
        wheels[v].write_bytes(wheel_bytes(v))
        out = json.loads(ok(cluster.ctl("release", "publish", str(wheels[v]), "--json")))
        assert (out["version"], out["new"]) == (v, True)
    listed = json.loads(ok(cluster.ctl("release", "list", "--json")))
    assert [r["version"] for r in listed] == ["0.2.0", "0.2.1rc1", "0.2.1"]
    assert [r["prerelease"] for r in listed] == [False, True, False]
    table = ok(cluster.ctl("release")).splitlines()
    assert table[0].split()[:2] == ["VERSION", "FILE"]
    assert [line.split()[0] for line in table[1:]] == ["0.2.0", "0.2.1rc1", "0.2.1"]
    # The scheduler's default release directory: <state_dir>/releases.
    kept = releases.ReleaseDir(cluster.tmp / "scheduler-state" / "releases")
    assert str(kept.newest().version) == "0.2.1"
    audit = cluster.admin("/v1/audit?action=release")
    assert [(e["action"], e["target"]) for e in audit] == [
        ("release.publish", "0.2.1"), ("release.publish", "0.2.0"),
        ("release.publish", "0.2.1rc1"),
    ]  # fmt: skip


def test_a_changed_wheel_for_a_published_version_is_refused_in_one_line(cluster):
    cluster.start_scheduler()
    wheel = cluster.tmp / "llmgw-0.2.0-py3-none-any.whl"
    wheel.write_bytes(wheel_bytes("0.2.0"))
    ok(cluster.ctl("release", "publish", str(wheel)))
    again = cluster.ctl("release", "publish", str(wheel))
    assert again.returncode == 0 and "already published" in again.stderr
    wheel.write_bytes(wheel_bytes("0.2.0", extra=b"changed"))
    refused = cluster.ctl("release", "publish", str(wheel))
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "already published" in line and "0.2.1rc1" in line
    not_ours = cluster.tmp / "other-1.0-py3-none-any.whl"
    not_ours.write_bytes(b"x")
    refused = cluster.ctl("release", "publish", str(not_ours))
    assert refused.returncode == 1 and "not of llmgw" in refused.stderr
