"""`llmgw keys rotate-scheduler`: a new scheduler keypair, with an overlap in which
peers trust both, so agents and routers follow it without a restart and the old key
stops being served."""

import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from llmgw import bus
from tests.helpers import eventually
from tests.system.conftest import GiB


def handshake(endpoint: str, client_secret_file, server_public: str) -> str:
    """Connect a CURVE DEALER and say how its first handshake ends: ok or failed."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(str(client_secret_file))
    sock.curve_serverkey = server_public.encode()
    sock.linger = 0
    mon = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    sock.connect(endpoint)
    try:
        if not mon.poll(10_000):
            return "no answer"
        event = parse_monitor_message(mon.recv_multipart())["event"]
        return "ok" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "failed"
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def test_peers_follow_a_scheduler_key_rotation_and_the_old_key_is_no_longer_served(
    cluster, api_key
):
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    agent = cluster.start_agent("node-a", memory=2 * GiB)
    router = cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")
    curve = cluster.etc / "pki" / "curve"
    old = bus.load_public(curve, bus.SCHEDULER)
    cluster.register("probe")  # a registered keypair to knock with

    begun = cluster.ctl("keys", "rotate-scheduler")
    assert begun.returncode == 0, begun.stderr
    new = bus.load_public(curve, bus.NEXT_SCHEDULER)
    assert new != old and new in begun.stdout
    assert bus.load_public(curve, bus.SCHEDULER) == old  # nothing served differently yet
    assert handshake(cluster.bus, curve / "probe.key_secret", old) == "ok"

    finished = cluster.ctl("keys", "rotate-scheduler", "--finish")
    assert finished.returncode == 0, finished.stderr
    assert bus.load_public(curve, bus.SCHEDULER) == new
    assert bus.load_public(curve, bus.RETIRED_SCHEDULER) == old

    eventually(
        lambda: handshake(cluster.bus, curve / "probe.key_secret", new) == "ok",
        timeout=15,
        what="the scheduler to serve with its new key",
    )
    assert handshake(cluster.bus, curve / "probe.key_secret", old) == "failed"
    # The agent and the router, started with the old key, follow without a restart.
    eventually(lambda: "scheduler_key_tried" in agent.log(), timeout=30, what="the agent")
    eventually(lambda: "scheduler_key_tried" in router.log(), timeout=30, what="the router")
    seen = cluster.admin("/v1/nodes")[0]["last_seen"]
    eventually(
        lambda: cluster.admin("/v1/nodes")[0]["last_seen"] > seen + 1,
        timeout=30,
        what="the agent's heartbeats on the new key",
    )
    assert agent.p.poll() is None and router.p.poll() is None
    assert cluster.serves("m")
    actions = [e["action"] for e in cluster.admin("/v1/audit?action=scheduler_key")]
    assert actions == ["scheduler_key.begin", "scheduler_key.finish"]
