"""Tenancy, limits, budgets and usage through the scheduler's admin API, with the real
`llmgw` CLI: every change is audited, every mistake is one line."""

import json

from tests.helpers import eventually


def ok(cluster, *args):
    result = cluster.ctl(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if "--json" in args else result


def test_tenancy_limits_and_budgets_are_made_through_the_api_and_audited(cluster):
    cluster.add_model("m")
    cluster.start_scheduler()
    ok(cluster, "orgs", "create", "acme")
    ok(cluster, "teams", "create", "research", "--org", "acme")
    user = ok(cluster, "users", "create", "ada@acme.org", "--team", "research", "--json")
    assert (user["org"], user["team"]) == ("acme", "research")
    project = ok(cluster, "projects", "create", "bot", "--org", "acme", "--band", "gold", "--json")
    assert project["band"] == "gold"
    key = ok(cluster, "keys", "create", "--name", "bot", "--user", "ada@acme.org",
             "--project", "bot", "--json")  # fmt: skip
    assert (key["user"], key["project"]) == ("ada@acme.org", "bot")
    limits = ok(cluster, "limits", "set", "--user", "ada@acme.org", "--rpm", "60", "--json")
    assert (limits["rpm"], limits["tpm"]) == (60, None)
    ok(cluster, "limits", "set", "--user", "ada@acme.org", "--tpm", "1000", "--json")
    budget = ok(cluster, "budgets", "set", "--org", "acme", "--period", "month", "--cost",
                "12.5", "--json")  # fmt: skip
    assert budget["cost"] == 12.5 and budget["used"] == {"cost": 0.0}

    shown = ok(cluster, "users", "show", "ada@acme.org", "--json")
    assert shown["keys"] == [key["id"]]
    assert (shown["limits"]["rpm"], shown["limits"]["tpm"]) == (60, 1000)
    assert ok(cluster, "orgs", "show", "acme", "--json")["users"] == ["ada@acme.org"]
    assert [r["subject"] for r in ok(cluster, "limits", "list", "--json")] == ["ada@acme.org"]
    assert "acme" in ok(cluster, "budgets", "list").stdout

    ok(cluster, "limits", "remove", "--user", "ada@acme.org", "--rpm")
    (left,) = ok(cluster, "limits", "list", "--json")
    assert (left["rpm"], left["tpm"]) == (None, 1000)
    entries = ok(cluster, "audit", "--json")
    assert [(e["action"], e["target"]) for e in entries] == [
        ("orgs.create", "acme"),
        ("teams.create", "research"),
        ("users.create", "ada@acme.org"),
        ("projects.create", "bot"),
        ("keys.create", key["id"]),
        ("limits.set", "user:ada@acme.org"),
        ("limits.set", "user:ada@acme.org"),
        ("budgets.set", "org:acme"),
        ("limits.remove", "user:ada@acme.org"),
    ]
    assert entries[4]["detail"]["project"] == "bot"
    assert entries[5]["detail"] == {"rpm": 60, "token": "bootstrap"}


def test_mistakes_are_one_line_errors_and_change_nothing(cluster):
    cluster.add_model("m")
    cluster.start_scheduler()
    assert ok(cluster, "orgs", "create", "acme")

    def fails(*args, says):
        result = cluster.ctl(*args)
        assert result.returncode == 1, result.stdout
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
        return result

    fails("orgs", "create", "acme", says="exists already")
    fails("users", "create", "ada", says="needs an org")
    fails("users", "create", "ada", "--org", "nope", says="no org 'nope'")
    fails("projects", "create", "p", "--org", "acme", "--band", "platinum", says="router.bands")
    fails("keys", "create", "--name", "k", "--user", "ghost", says="no user 'ghost'")
    fails("limits", "set", "--org", "acme", says="say which limits")
    fails("budgets", "set", "--team", "nope", "--period", "day", "--tokens", "5",
          says="no team 'nope'")  # fmt: skip
    ok(cluster, "users", "create", "ada", "--org", "acme")
    fails("orgs", "remove", "acme", says="still has users: ada")
    ok(cluster, "users", "remove", "ada")
    ok(cluster, "orgs", "remove", "acme")
    assert ok(cluster, "orgs", "list", "--json") == []


def test_usage_reports_and_the_rollup_go_through_the_api(served):
    key = json.loads(served.ctl("keys", "create", "--name", "u", "--json").stdout)
    served.secret = key["secret"]
    eventually(lambda: served.chat("m").status_code == 200, what="the new key to work")
    rows = eventually(
        lambda: [r for r in ok(served, "usage", "--by", "key", "--json") if r["key"] == key["id"]],
        what="the usage row",
    )
    assert rows[0]["requests"] >= 1 and rows[0]["completion_tokens"] >= 5
    done = ok(served, "usage", "rollup", "--json")
    assert done["raw_rows_pruned"] == 0
    assert ok(served, "audit", "--action", "usage", "--json")[0]["action"] == "usage.rollup"
