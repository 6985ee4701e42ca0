"""llmgw-agentd end to end: the real agent and real engine processes on loopback."""

import os
import signal
import sys
from pathlib import Path

import requests

from tests.agentd.conftest import MEMORY, NODE, Node, start_body
from tests.helpers import eventually, free_port


def chat(endpoint: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    return requests.post(endpoint + "/v1/chat/completions", json=body, headers=headers,
                         timeout=5).status_code  # fmt: skip


def engine_processes(key_file: Path) -> list[int]:
    """Live processes started with this shard's key file on their command line."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(key_file).encode() in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def start_ready(scheduler, node: Node, shard_id: str, source: str) -> dict:
    scheduler.send(NODE, "start_shard", start_body(shard_id, source))
    return node.remember(scheduler.wait_shard(shard_id, "ready"))


def test_the_agent_says_hello_with_its_resources_and_keeps_heartbeating(scheduler, node):
    metrics_port = free_port()
    node.start(metrics_listen=f"127.0.0.1:{metrics_port}")
    hello = scheduler.wait("hello")
    assert hello["node"] == NODE
    assert hello["resources"]["memory_total"] == MEMORY
    assert hello["resources"]["memory_available"] == MEMORY
    assert hello["resources"]["cpus"] == os.cpu_count()
    assert hello["engines"]["fake-1"] == {"state": "installed", "reason": ""}
    assert hello["shards"] == []
    assert scheduler.messages("hello")[0]["sender"] == NODE  # from CURVE, not the message
    eventually(lambda: len(scheduler.messages("heartbeat")) >= 2, what="two heartbeats")

    def metric():
        text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
        return "llmgw_agent_memory_available_bytes 8.589934592e+09" in text

    eventually(metric, what="the memory gauge")


def test_a_started_shard_becomes_ready_and_answers_only_with_its_engine_key(
    scheduler, node, model_file
):
    node.start()
    scheduler.wait("hello")
    shard = start_ready(scheduler, node, "r-1", str(model_file))
    states = scheduler.shard_states("r-1")
    assert states[0] == "starting" and states[-1] == "ready"
    assert shard["endpoint"] == f"http://127.0.0.1:{shard['port']}"
    assert node.ports[0] <= shard["port"] <= node.ports[1]
    assert chat(shard["endpoint"], "key-for-r-1") == 200
    assert chat(shard["endpoint"], None) == 401
    key_file = node.state / "shards" / "r-1.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    # Starting an id that already runs only answers with its status.
    scheduler.forget()
    scheduler.send(NODE, "start_shard", start_body("r-1", str(model_file)))
    assert scheduler.wait_shard("r-1", "ready")["pid"] == shard["pid"]
    assert engine_processes(key_file) == [shard["pid"]]
    heartbeat = scheduler.wait("heartbeat", lambda b: b["shards"])
    assert heartbeat["shards"][0]["rss"] > 0
    assert heartbeat["resources"]["memory_available"] < MEMORY


def test_a_stopped_shard_is_reported_stopped_and_its_process_is_gone(scheduler, node, model_file):
    agent = node.start()
    scheduler.wait("hello")
    scheduler.send(NODE, "start_shard", start_body("r-1", str(model_file)), epoch=3)
    shard = node.remember(scheduler.wait_shard("r-1", "ready"))
    # A scheduler that lost its lease (older epoch) is not obeyed.
    scheduler.send(NODE, "stop_shard", {"id": "r-1"}, epoch=2)
    eventually(lambda: "stale_command" in agent.log(), what="the stale stop to be refused")
    assert chat(shard["endpoint"], "key-for-r-1") == 200
    scheduler.send(NODE, "stop_shard", {"id": "r-1"}, epoch=3)
    scheduler.wait_shard("r-1", "stopped")
    assert engine_processes(node.state / "shards" / "r-1.key") == []
    assert not (node.state / "shards" / "r-1.json").exists()
    assert not (node.state / "shards" / "r-1.key").exists()
    # Reported once more in a heartbeat, then forgotten.
    eventually(lambda: scheduler.messages("heartbeat")[-1]["body"]["shards"] == [],
               what="the stopped shard to be forgotten")  # fmt: skip


def test_an_engine_that_exits_at_once_fails_with_its_last_output_as_the_reason(
    scheduler, node, model_file
):
    broken = [sys.executable, "-c", "print('cannot load model: bad magic'); raise SystemExit(3)"]
    node.start(engines={"broken": broken})
    scheduler.wait("hello")
    scheduler.send(NODE, "start_shard", start_body("r-2", str(model_file), engine="broken"))
    failed = scheduler.wait_shard("r-2", "failed")
    assert "status 3" in failed["reason"]
    assert "cannot load model: bad magic" in failed["reason"]


def test_a_shard_whose_weights_do_not_match_their_sha256_fails_and_the_file_is_not_kept(
    scheduler, node, model_file
):
    node.start()
    scheduler.wait("hello")
    body = start_body("r-3", model_file.as_uri(), sha256="0" * 64)
    scheduler.send(NODE, "start_shard", body)
    failed = scheduler.wait_shard("r-3", "failed")
    assert "sha256" in failed["reason"] and "0" * 64 in failed["reason"]
    assert [p for p in (node.state / "weights").rglob("*") if p.is_file()] == []


def test_engines_outlive_a_killed_agent_and_the_next_agent_adopts_them(scheduler, node, model_file):
    first = node.start()
    scheduler.wait("hello")
    shard = start_ready(scheduler, node, "r-4", str(model_file))
    first.stop(signal.SIGKILL)
    assert chat(shard["endpoint"], "key-for-r-4") == 200

    scheduler.forget()
    node.start()
    hello = scheduler.wait("hello")
    (adopted,) = hello["shards"]
    assert (adopted["id"], adopted["state"], adopted["pid"]) == ("r-4", "ready", shard["pid"])
    assert adopted["endpoint"] == shard["endpoint"]
    assert engine_processes(node.state / "shards" / "r-4.key") == [shard["pid"]]
    # It is watched like any other: when it dies, the agent says so.
    os.killpg(shard["pid"], signal.SIGKILL)
    failed = scheduler.wait_shard("r-4", "failed")
    assert failed["pid"] == shard["pid"]


def test_a_terminated_agent_exits_cleanly_and_leaves_its_engines_running(
    scheduler, node, model_file
):
    agent = node.start()
    scheduler.wait("hello")
    shard = start_ready(scheduler, node, "r-6", str(model_file))
    assert agent.stop(signal.SIGTERM) == 0
    assert chat(shard["endpoint"], "key-for-r-6") == 200
    assert (node.state / "shards" / "r-6.json").exists()


def test_a_shard_that_died_while_the_agent_was_down_is_reported_failed_and_cleaned_up(
    scheduler, node, model_file
):
    first = node.start()
    scheduler.wait("hello")
    shard = start_ready(scheduler, node, "r-5", str(model_file))
    first.stop(signal.SIGKILL)
    os.killpg(shard["pid"], signal.SIGKILL)
    eventually(lambda: not engine_processes(node.state / "shards" / "r-5.key"),
               what="the engine to die")  # fmt: skip

    scheduler.forget()
    node.start()
    hello = scheduler.wait("hello")
    (lost,) = hello["shards"]
    assert (lost["id"], lost["state"]) == ("r-5", "failed")
    assert lost["reason"] == "not running after agent restart"
    assert not (node.state / "shards" / "r-5.json").exists()
    assert not (node.state / "shards" / "r-5.key").exists()


def test_an_agent_whose_key_is_not_registered_gets_nothing_through_until_it_is(scheduler, tmp_path):
    stranger = Node(tmp_path, scheduler, name="node-x")  # keypair made, not registered
    try:
        agent = stranger.start()
        eventually(lambda: stranger.public in scheduler.auth.knocked,
                   what="the scheduler to refuse the stranger's key")  # fmt: skip
        eventually(lambda: "scheduler_refused" in agent.log(),
                   what="the agent to say the scheduler refuses its key")  # fmt: skip
        assert "key not registered (run `llmgw nodes add node-x`" in agent.log()
        assert "scheduler_unreachable" not in agent.log()
        assert scheduler.pump() == []
        # Registered later (`llmgw nodes add` after the agent started), it gets in.
        scheduler.register(stranger.name, stranger.public)
        hello = scheduler.wait("hello", timeout=20)
        assert hello["node"] == "node-x"
    finally:
        stranger.cleanup()


def test_a_missing_keypair_is_a_one_line_error(tmp_path):
    from click.testing import CliRunner

    from llmgw_agentd.main import main

    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[paths]\nconfig_dir = "{tmp_path}"\n[agent]\nname = "nobody"\n')
    result = CliRunner().invoke(main, ["--config", str(cfg)])
    assert result.exit_code == 1
    assert (
        f"no CURVE keypair at {tmp_path / 'pki' / 'curve' / 'nobody.key_secret'}" in result.output
    )
    assert "run `llmgw nodes add nobody` on the control plane" in result.output
    assert "copy nobody.key_secret and scheduler.key here" in result.output
    assert "Invalid certificate file" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_bad_config_is_a_one_line_error(tmp_path):
    from click.testing import CliRunner

    from llmgw_agentd.main import main

    cfg = tmp_path / "agent.toml"
    cfg.write_text("[agent]\nheartbeats = 1\n")
    result = CliRunner().invoke(main, ["--config", str(cfg)])
    assert result.exit_code == 1
    assert "unknown key 'agent.heartbeats'" in result.output


def test_a_deposed_leader_is_told_its_epoch_is_stale_even_after_the_agent_restarts(
    scheduler, node, model_file
):
    agent = node.start()
    scheduler.wait("hello")
    scheduler.send(NODE, "leader", {"epoch": 5, "name": "s2"}, epoch=5)
    eventually(lambda: "leader_epoch epoch=5" in agent.log(), what="the new epoch")
    assert (node.state / "epoch").read_text().strip() == "5"
    agent.stop()

    scheduler.forget()
    agent = node.start()
    scheduler.wait("hello")
    # The old leader (epoch 4) asks for a start: refused, and told why.
    scheduler.send(NODE, "start_shard", start_body("r-9", str(model_file)), epoch=4)
    refused = scheduler.wait("refused")
    assert refused["type"] == "start_shard" and refused["epoch"] == 4
    assert "older than epoch 5" in refused["reason"]
    assert "shard_accepted" not in agent.log()
    # Its heartbeats carry the newest epoch, so a deposed leader hears of it anyway.
    scheduler.wait("heartbeat")
    assert {m["epoch"] for m in scheduler.messages("heartbeat")} == {5}
