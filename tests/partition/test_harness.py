"""The harness itself: hosts that reach each other over the bridge until a fault says
otherwise, and a fleet that serves across them."""

import subprocess
import sys

import pytest
import requests

from tests.helpers import eventually

from .fleet import REAL_MODEL
from .net import Network

pytestmark = [pytest.mark.partition, pytest.mark.timeout(180)]


def _listen(net: Network, host: str, port: int) -> subprocess.Popen:
    """A TCP server inside `host` that answers each connection with its name."""
    code = (
        "import socket,sys\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(({net[host].addr!r}, {port})); s.listen(); print('up', flush=True)\n"
        f"while True:\n c,_=s.accept(); c.sendall({host!r}.encode()); c.close()\n"
    )
    p = subprocess.Popen(net[host].exec([sys.executable, "-c", code]), stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"up"
    return p


def _reaches(net: Network, frm: str, to: str, port: int) -> bool:
    """Whether `frm` (a host, or "root") gets `to`'s answer within a second."""
    code = (
        "import socket\n"
        f"s=socket.create_connection(({net[to].addr!r}, {port}), timeout=1)\n"
        "print(s.recv(100).decode())\n"
    )
    argv = [sys.executable, "-c", code]
    r = subprocess.run(argv if frm == "root" else net[frm].exec(argv), capture_output=True,
                       text=True, timeout=10)  # fmt: skip
    return r.returncode == 0 and r.stdout.strip() == to


def test_a_cut_drops_traffic_between_two_hosts_only_and_heals(net):
    for h in ("ha", "hb", "hc"):
        net.add(h)
    servers = [_listen(net, h, 9000) for h in ("ha", "hb", "hc")]
    try:
        assert _reaches(net, "ha", "hb", 9000) and _reaches(net, "root", "hb", 9000)
        net.cut("ha", "hb")
        assert not _reaches(net, "ha", "hb", 9000)
        assert not _reaches(net, "hb", "ha", 9000)
        assert _reaches(net, "ha", "hc", 9000) and _reaches(net, "root", "hb", 9000)
        net.heal("ha", "hb")
        assert _reaches(net, "ha", "hb", 9000)
        net.cut("ha", "hb", oneway=True)  # what ha sends hb is lost: no connection either way
        assert not _reaches(net, "ha", "hb", 9000)
        net.heal_all()
        net.split(("ha",), ("hb", "hc"))
        assert not _reaches(net, "ha", "hc", 9000) and not _reaches(net, "hb", "ha", 9000)
        assert _reaches(net, "hb", "hc", 9000)
        net.join(("ha",), ("hb", "hc"))
        assert _reaches(net, "ha", "hc", 9000) and _reaches(net, "hb", "ha", 9000)
        net.link_down("hc")
        assert not _reaches(net, "root", "hc", 9000)
        net.link_up("hc")
        eventually(lambda: _reaches(net, "root", "hc", 9000), timeout=10, what="hc's link up")
    finally:
        for p in servers:
            p.kill()
            p.wait()
            p.stdout.close()


def test_a_network_leaves_nothing_behind_and_a_dead_runs_leftovers_are_swept():
    from .net import MARKERS, _links, _namespaces, sweep

    n = Network()
    n.add("x")
    n.close()
    assert not [x for x in _namespaces() + _links() if x.startswith(f"lgw{n.id}-")]
    dead = Network()
    dead.add("x")
    dead.marker.write_text("999999999\n")  # as if its run had died
    sweep()
    assert not [x for x in _namespaces() + _links() if x.startswith(f"lgw{dead.id}-")]
    assert not (MARKERS / f"{dead.id}.pid").exists()


def test_a_fleet_across_hosts_serves_through_both_routers(hosts):
    f = hosts
    f.add_model("m", min_=2, max_=2)
    f.start()
    for r in f.routers:
        url = f.router_url(r)

        def answers(url=url):
            return (
                requests.post(
                    f"{url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {f.secret}"},
                    timeout=5,
                ).status_code
                == 200
            )

        eventually(answers, timeout=40, what=f"{r} to serve m")
    ready = [x for x in f.replicas() if x["state"] == "ready"]
    assert len(ready) == 2
    # each replica's engine listens on its agent host's own address
    assert all(x["endpoint"].startswith(f"http://{f.addr(x['node'])}:") for x in ready), ready
    # the agents say which leader's commands they obeyed
    epoch = f.admin("/v1/status")["control_plane"]["epoch"]
    assert f": command_accepted type=start_shard epoch={epoch}" in f.logs(ready[0]["node"])


@pytest.mark.e2e
def test_a_real_llama_server_on_its_own_host_answers_through_a_router_on_another(hosts):
    f = hosts
    f.add_model("gemma", memory=0, **REAL_MODEL)
    f.start(agents=(), routers=("r1",))
    f.start_agent("a4", memory=0)  # the machine's own memory

    def answered():
        r = requests.post(
            f"{f.router_url('r1')}/v1/completions",
            json={"model": "gemma", "prompt": "The capital of France is", "max_tokens": 4},
            headers={"Authorization": f"Bearer {f.secret}"},
            timeout=30,
        )
        assert r.status_code in (200, 503), r.text  # 503: placed, loading
        return r.status_code == 200 and r.json()["choices"][0]["text"]

    eventually(answered, timeout=180, interval=0.5, what="gemma to answer through r1")
    (replica,) = f.replicas()
    assert replica["node"] == "a4" and f.addr("a4") in replica["endpoint"]
