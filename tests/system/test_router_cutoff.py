"""A router cut off from the schedulers (the scheduler SIGSTOPped: no FIN, as in a
partition) keeps serving what its last table serves and answers a model it cannot have
started at once, rather than holding the request for the activation window."""

import signal
import threading
import time

import requests

from tests.helpers import eventually
from tests.system.conftest import GiB


def health(cluster) -> dict:
    return requests.get(f"{cluster.router_url}/health", timeout=5).json()


def router_metric(cluster, name: str) -> float:
    text = requests.get(f"{cluster.router_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_router_cut_off_from_the_schedulers_serves_its_table_and_refuses_activation_at_once(
    cluster, api_key
):
    cluster.add_model("m", memory=GiB)
    cluster.add_model("lazy", memory=GiB, min_=0)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=3 * GiB)
    cluster.start_router(api_key[1])  # activation window: 20 s
    eventually(lambda: cluster.serves("m"), timeout=30, what="m to be served")
    assert health(cluster)["control_plane"]["reachable"] is True
    assert router_metric(cluster, "llmgw_router_table_age_seconds") < 5

    sched = cluster.scheduler
    sched.p.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # Asked for before the router knows it is cut off: it waits, and is answered as
        # soon as the router gives up on the schedulers, not at the window's end.
        early = {}

        def ask_early():
            early["r"] = cluster.chat("lazy", timeout=30)
            early["s"] = time.monotonic() - t0

        asker = threading.Thread(target=ask_early)
        asker.start()
        eventually(lambda: health(cluster)["control_plane"]["reachable"] is False,
                   timeout=20, what="the router to see it is cut off")  # fmt: skip
        asker.join(10)
        assert early["r"].status_code == 503, early["r"].text
        assert early["r"].json()["error"]["code"] == "control_plane_unreachable"
        assert early["s"] < 16, f"held {early['s']:.1f}s: the activation window is 20 s"

        # It stays ready: the load balancer keeps sending it what it can serve.
        assert requests.get(f"{cluster.router_url}/ready", timeout=5).status_code == 200
        assert router_metric(cluster, "llmgw_router_table_age_seconds") > 10
        for _ in range(5):
            assert cluster.chat("m").status_code == 200

        t1 = time.monotonic()
        r = cluster.chat("lazy", timeout=30)
        took = time.monotonic() - t1
        assert r.status_code == 503 and took < 2.0, (r.status_code, took)
        err = r.json()["error"]
        assert err["code"] == "control_plane_unreachable" and err["type"] == "server_error"
        assert "has not heard from the schedulers for" in err["message"]
        assert int(r.headers["Retry-After"]) > 0
        refused = 'llmgw_router_control_plane_unreachable_total{model="lazy"}'
        assert router_metric(cluster, refused) == 2
        assert ": control_plane_unreachable " in cluster.router.log()
    finally:
        sched.p.send_signal(signal.SIGCONT)

    eventually(lambda: health(cluster)["control_plane"]["reachable"] is True,
               timeout=15, what="the router to hear the scheduler again")  # fmt: skip
    assert ": control_plane_reachable " in cluster.router.log()
    r = cluster.chat("lazy", timeout=30)
    assert r.status_code == 200, r.text
    print(f"refused in {took * 1000:.0f} ms; the early request after {early['s']:.1f}s")
