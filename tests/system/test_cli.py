"""`llmgw status`, `models`, `replicas`, `nodes`, `explain-placement` and `retry` against a
real scheduler's admin API, with agents and the fake engine on loopback."""

import json

from tests.helpers import eventually, free_port, llmgw
from tests.system.conftest import GiB

NODE_KEYS = {
    "name",
    "state",
    "cpus",
    "memory_total",
    "memory_available",
    "gpus",
    "engines",
    "replicas",
    "last_seen",
    "version",
    "disk_total",
    "disk_free",
    "fetching",
    "topology",
}
MODEL_KEYS = {
    "name",
    "aliases",
    "engine",
    "min",
    "max",
    "desired",
    "desired_reason",
    "ready",
    "lost",
    "replicas",
    "state",
    "reason",
    "failures",
    "retry_at",
    "memory",
}
REPLICA_KEYS = {
    "id",
    "model",
    "profile",
    "node",
    "state",
    "endpoint",
    "created",
    "since",
    "rss",
    "reason",
    "restart",
    "stale",
    "idle_s",
}
PLACEMENT_KEYS = {"model", "profile", "profiles", "need", "choice", "install", "nodes"}


def ok(result) -> str:
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    return result.stdout


def ctl_json(cluster, *args):
    return json.loads(ok(cluster.ctl(*args, "--json")))


def section(text: str, title: str) -> list[str]:
    """The lines of one section of `llmgw status`, its header row included."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def row(lines: list[str], first: str) -> list[str]:
    (found,) = [line.split() for line in lines if line.split()[0] == first]
    return found


def model_state(cluster, name: str) -> str:
    return {m["name"]: m["state"] for m in ctl_json(cluster, "models")}[name]


def test_status_shows_the_served_model_ready_on_node_a_and_both_nodes_up(served):
    out = ok(served.ctl("status"))
    nodes = section(out, "NODES")
    assert nodes[0].split()[:2] == ["NAME", "STATE"]
    assert row(nodes, "node-a")[1] == "up"
    assert row(nodes, "node-b")[1] == "up"
    assert row(nodes, "node-a")[2].endswith("/2.0")  # GiB free/total, as the agent reports
    assert row(section(out, "MODELS"), "m")[1:3] == ["1/1", "serving"]
    replica = [r for r in section(out, "REPLICAS")[1:] if r.split()[1] == "m"]
    assert len(replica) == 1
    assert replica[0].split()[2:4] == ["node-a", "ready"]


def test_json_output_is_the_api_object_with_one_shape_per_object_in_every_command(served):
    status = ctl_json(served, "status")
    assert set(status) == {"nodes", "models", "replicas", "restarts", "control_plane"}
    assert status["control_plane"]["role"] == "leader"
    assert status["control_plane"]["leader"]["name"] == status["control_plane"]["name"]
    assert status["restarts"] == []
    assert {n["name"] for n in status["nodes"]} == {"node-a", "node-b"}
    assert all(set(n) == NODE_KEYS for n in status["nodes"])
    assert all(set(m) == MODEL_KEYS for m in status["models"])
    assert all(set(r) == REPLICA_KEYS for r in status["replicas"])

    nodes = ctl_json(served, "nodes")
    assert [set(n) for n in nodes] == [NODE_KEYS, NODE_KEYS]
    assert [n["name"] for n in ctl_json(served, "nodes", "list")] == [n["name"] for n in nodes]
    (m,) = ctl_json(served, "models")
    assert set(m) == MODEL_KEYS
    assert (m["name"], m["ready"], m["min"], m["state"]) == ("m", 1, 1, "serving")
    assert m["memory"] == GiB
    (r,) = ctl_json(served, "replicas", "--model", "m")
    assert set(r) == REPLICA_KEYS
    assert (r["model"], r["node"], r["state"]) == ("m", "node-a", "ready")
    assert ctl_json(served, "replicas", "--model", "other") == []
    placement = ctl_json(served, "explain-placement", "m")
    assert set(placement) == PLACEMENT_KEYS
    assert set(placement["need"]) == {"memory", "gpus", "engine"}
    assert (placement["profile"], placement["profiles"]) == ("default", ["default"])


def test_explain_placement_says_node_b_is_too_small_with_its_figures_and_chooses_node_a(served):
    out = ok(served.ctl("explain-placement", "m"))
    lines = out.splitlines()
    assert lines[0].startswith("m needs 1 GiB")
    assert row(lines, "node-a")[1] == "yes"
    assert " ".join(row(lines, "node-b")[1:]) == "no needs 1 GiB, 512 MiB free"
    assert lines[-1] == "choice: node-a"

    placement = ctl_json(served, "explain-placement", "m")
    assert placement["choice"] == "node-a"
    why = {n["name"]: (n["fits"], n["reason"]) for n in placement["nodes"]}
    assert why["node-b"] == (False, "needs 1 GiB, 512 MiB free")
    assert why["node-a"][0] is True


def test_an_unknown_model_is_refused_in_one_line_with_the_api_message(served):
    for args in (["explain-placement", "nope"], ["retry", "nope"]):
        result = served.ctl(*args)
        assert result.returncode == 1
        assert result.stderr == "Error: no model 'nope'\n"
        assert result.stdout == ""


def test_a_parked_model_stands_out_in_status_with_its_reason_and_retry_unparks_it(cluster):
    cluster.add_model("doomed", memory=GiB, engine="broken")
    cluster.add_model("fine", memory=GiB // 4)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    eventually(
        lambda: model_state(cluster, "doomed") == "parked", timeout=60, what="doomed to park"
    )

    result = cluster.ctl("status")
    models = section(ok(result), "MODELS")
    assert models[1].split()[:3] == ["doomed", "0/1", "parked"], "what needs action comes first"
    assert models[1].endswith("llama_model_load: error loading model: bad magic")
    assert "doomed is parked after 5 failed starts" in result.stderr
    assert "`llmgw retry doomed`" in result.stderr
    (doomed,) = [m for m in ctl_json(cluster, "models") if m["name"] == "doomed"]
    assert doomed["failures"] == 5
    assert "bad magic" in doomed["reason"]

    result = cluster.ctl("retry", "doomed")
    assert result.returncode == 0, "a queued change is not an error"
    assert result.stderr == "queued: retry doomed\n"
    assert result.stdout == ""
    eventually(lambda: model_state(cluster, "doomed") != "parked", what="doomed to leave parked")


def test_an_unplaceable_model_is_explained_with_no_choice(cluster):
    cluster.add_model("huge", memory=64 * GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    eventually(
        lambda: model_state(cluster, "huge") == "unplaceable",
        timeout=30,
        what="huge to fit nowhere",
    )
    result = cluster.ctl("status")
    assert row(section(ok(result), "MODELS"), "huge")[1:3] == ["0/1", "unplaceable"]
    assert "needs 64 GiB" in ok(result)
    assert "llmgw explain-placement huge" in result.stderr
    out = ok(cluster.ctl("explain-placement", "huge"))
    assert out.splitlines()[-1] == "choice: none; it fits no node"


def test_a_wrong_token_is_refused_in_one_line_that_says_where_the_token_came_from(cluster):
    cluster.start_scheduler()
    result = cluster.ctl("--token", "wrong", "status")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(
        f"Error: the scheduler at http://127.0.0.1:{cluster.admin_port} refused the admin token"
        " from --token"
    )
    result = llmgw(
        "--admin-url",
        f"http://127.0.0.1:{cluster.admin_port}",
        "models",
        env={"LLMGW_ADMIN_TOKEN": "wrong", "LLMGW_CONFIG": ""},
        check=False,
    )
    assert result.returncode == 1
    assert "refused the admin token from LLMGW_ADMIN_TOKEN" in result.stderr


def test_the_token_the_scheduler_wrote_is_found_through_the_config(cluster):
    cluster.start_scheduler()
    assert (cluster.etc / "secrets" / "admin.token").exists()
    assert ok(cluster.ctl("models", "--json")) == "[]\n"


def test_an_unreachable_scheduler_fails_in_one_line_naming_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    for env in ({}, {"LLMGW_ADMIN_URL": url}):
        args = [] if env else ["--admin-url", url]
        result = llmgw(
            *args,
            "--token",
            "t",
            "status",
            env={"LLMGW_CONFIG": "", "LLMGW_ADMIN_URL": "", **env},
            check=False,
        )
        assert result.returncode == 1
        assert result.stdout == ""
        assert result.stderr == (
            f"Error: cannot reach the scheduler at {url}: Connection refused"
            " (is llmgw-scheduler running? set --admin-url or LLMGW_ADMIN_URL)\n"
        )


def test_without_a_token_anywhere_the_error_says_how_to_give_one(tmp_path):
    cfg = tmp_path / "llmgw.toml"
    cfg.write_text(f'[paths]\nconfig_dir = "{tmp_path / "etc"}"\n')
    result = llmgw("--config", str(cfg), "status", env={"LLMGW_ADMIN_TOKEN": ""}, check=False)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert "pass --token, set LLMGW_ADMIN_TOKEN, or set scheduler.admin_token" in result.stderr
    assert str(tmp_path / "etc" / "secrets" / "admin.token") in result.stderr


def test_a_model_added_at_runtime_is_served_scaled_kept_across_restarts_and_removed(
    cluster, api_key, tmp_path
):
    import signal

    from tests.system.conftest import GiB

    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=4 * GiB)
    cluster.start_router(api_key[1])
    weights = tmp_path / "extra.gguf"
    weights.write_bytes(b"not really a model")
    definition = tmp_path / "extra.toml"
    definition.write_text(
        f'name = "extra"\nsource = "{weights}"\nengine = "fake"\nengine_version = "1"\n'
        "[profile]\nmemory_bytes = 1073741824\n"
    )
    added = cluster.ctl("models", "add", str(definition))
    assert added.returncode == 0, added.stderr
    eventually(lambda: cluster.serves("extra"), timeout=30, what="the new model to serve")

    scaled = cluster.ctl("scale", "extra", "--min", "2", "--max", "2")
    assert scaled.returncode == 0 and "queued: scale extra" in scaled.stderr
    eventually(lambda: len(cluster.shards("node-a")) == 2, timeout=30, what="two replicas")

    cluster.scheduler.stop(signal.SIGKILL)
    cluster.start_scheduler()

    def listed():
        result = cluster.ctl("models", "--json")
        models = {m["name"]: m for m in json.loads(result.stdout)} if result.returncode == 0 else {}
        return models.get("extra")

    extra = eventually(listed, what="the model after the restart")
    assert (extra["min"], extra["max"]) == (2, 2)

    assert cluster.ctl("models", "remove", "extra").returncode == 0
    eventually(lambda: cluster.shards("node-a") == [], timeout=30, what="its replicas to stop")
    again = cluster.ctl("models", "add", str(definition))
    assert again.returncode == 0
    dup = cluster.ctl("models", "add", str(definition))
    assert dup.returncode == 1 and dup.stderr.strip() == "Error: model 'extra' exists already"


def test_a_bad_runtime_model_is_refused_naming_the_field(cluster, tmp_path):
    cluster.start_scheduler()
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "web"\nsource = "https://example.org/w.gguf"\n')
    result = cluster.ctl("models", "add", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: model 'web': sha256 is required for a https source, so a wrong file is never used"
    )
    assert cluster.ctl("models", "remove", "nope").returncode == 1


def test_logs_shows_what_an_engine_wrote_through_its_agent(served):
    (shard,) = served.shards("node-a")
    result = served.ctl("logs", "node-a", "--shard", shard["id"], "--lines", "5")
    assert result.returncode == 0, result.stderr
    assert "fake engine" in result.stdout and "listening on port" in result.stdout
    missing = served.ctl("logs", "node-a", "--shard", "r-nope")
    assert missing.returncode == 1 and "no shard r-nope" in missing.stderr
    gone = served.ctl("logs", "node-z", "--shard", shard["id"])
    assert gone.returncode == 1 and "node 'node-z' is not connected" in gone.stderr
    # A replica id alone is enough: it is unique, and its node is looked up.
    by_id = served.ctl("logs", shard["id"], "--lines", "5")
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == result.stdout
    unknown = served.ctl("logs", "r-nope")
    assert unknown.returncode == 1 and "llmgw logs NODE --shard r-nope" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
